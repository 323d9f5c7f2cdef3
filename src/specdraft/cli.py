"""Command line: ``specdraft generate`` and ``specdraft drafters``.

torch and transformers are imported only inside ``generate``, so ``--help`` and
``specdraft drafters`` answer at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from . import __version__
from .errors import ConfigError, SpecdraftError
from .cli_args import (decoder_args, device_args, parse_drafter_option, resolve_drafter, resolve_methods,
                       speculative_config_arg, structured_args)
from .models import TRAIN_DTYPES


#: the most bytes ``generate`` reads as its prompt (standard input, or the argument) or as its
#: ``--prediction``: far more than any model's context holds as text, and bounded before any model loads
MAX_PROMPT_BYTES = 8 * 1024 * 1024

#: ``generate``'s flags that are :class:`~specdraft.SamplingParams` fields (same names)
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")


def _training_args(p: argparse.ArgumentParser, steps: int, steps_help: str, lr: float, head_tokens_help: str) -> None:
    """The options ``distill`` and ``train-heads`` share."""
    p.add_argument("--prompts", nargs="+", required=True, metavar="FILE.jsonl",
                   help="training prompts: self-instruct, GSM8K or {\"prompt\": ...} JSONL (never the prompts "
                        "you benchmark on)")
    p.add_argument("--target", default=None, help="as for generate (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=600, help="prompts the target answers (default: 600)")
    p.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="also N prompts the target writes itself from its chat template's user turn, and its "
                        "answers: more varied data (default: 0)")
    p.add_argument("--document-prompts", type=int, default=0, metavar="N",
                   help="also N prompts asking the target to summarize, extract from or rewrite documents made "
                        "of its own answers: long inputs, as in summarization and RAG (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length (default: 128)")
    p.add_argument("--generate-batch-size", type=int, default=16, metavar="N",
                   help="prompts the target answers at once while building the data; raise it on a GPU "
                        "(default: 16)")
    p.add_argument("--steps", type=int, default=steps, help=f"{steps_help} (default: {steps})")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--lr", type=float, default=lr, help=f"peak learning rate, > 0 (default: {lr:g})")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompt mix, sampled answers, batches and fresh weights: the same seed and "
                        "inputs give the same weights (default: 0)")
    p.add_argument("--head-tokens", type=int, default=8192, help=f"{head_tokens_help} (default: 8192)")
    p.add_argument("--train-dtype", choices=TRAIN_DTYPES, default="auto",
                   help="precision of the training steps' matrix products (autocast): auto = bfloat16 where the "
                        "hardware multiplies it fast (AMX CPUs, CUDA), else float32 (default: auto)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)


def _check_positive(args, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")


def _check_training_args(args, *positive: str, non_negative: Sequence[str] = ()) -> None:
    """Check what ``distill`` and ``train-heads`` share (:func:`_training_args`, ``--gate-steps``),
    then the command's own ``positive`` (>= 1) and ``non_negative`` (>= 0) options, then that
    the prompt files hold prompts: all before the model loads."""
    from .training.data import load_prompts
    from .training.loop import check_lr

    _check_positive(args, "num_prompts", "max_new_tokens", "batch_size", "generate_batch_size", *positive)
    for name in ("self_prompts", "document_prompts", "gate_steps", *non_negative):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    check_lr(args.lr)
    _check_folder(args.output, "--output")
    if args.work is not None:
        _check_folder(args.work, "--work")
    load_prompts(args.prompts, limit=1)  # a missing or empty file, or a bad line in one


def _check_folder(path: str, flag: str) -> None:
    """``flag``'s folder ``path`` is a folder or can be made: neither it nor a folder above it is a file."""
    wanted = Path(path).expanduser()
    for where in (wanted, *wanted.parents):
        if where.exists():
            if where.is_dir():
                return
            if where == wanted:
                raise ConfigError(f"{flag} {path!r} is a file; give a folder (it is made if missing)")
            raise ConfigError(f"{flag} {path!r} cannot be made: {str(where)!r} is a file, not a folder")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdraft", description="Exact speculative decoding with pluggable drafters.")
    parser.add_argument("--version", action="version", version=f"specdraft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate text; output equals plain decoding of the target.")
    gen.add_argument("prompt", help="the prompt (the user's message for chat models); '-' reads stdin")
    decoder_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default: 128")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 = greedy (default); else from 0.0001 to 100")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = off (default)")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="keep tokens at least MIN_P times as likely as the most likely one; 0 = off (default)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 1 discourages tokens already in the prompt or output (transformers' semantics); "
                          "1 = off (default)")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="-2 to 2, subtracted from the logit of tokens the output already has (OpenAI's); "
                          "0 = off (default)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="-2 to 2, times a token's count in the output, subtracted from its logit (OpenAI's); "
                          "0 = off (default)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling, 0 to 2**64 - 1")
    gen.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                     help="token id that ends the answer like end-of-sequence (repeatable)")
    gen.add_argument("--min-tokens", type=int, default=0, metavar="N",
                     help="generate at least N tokens: no end-of-sequence, stop token or stop string before them")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at end-of-sequence; generate until --max-new-tokens (or a stop)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--prediction", metavar="FILE", default=None,
                     help="text the answer is expected to repeat much of (a file being edited; OpenAI's Predicted "
                          "Outputs): drafted from with any --drafter, the answer stays the model's own")
    structured_args(gen)
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    gen.add_argument("--stats", action="store_true", help="print speculation metrics to stderr")
    device_args(gen)

    bench = sub.add_parser("bench", help="benchmark drafters against plain decoding on Spec-Bench-style prompts",
                           description="Run plain decoding, each drafter and optional peers on every prompt, "
                                       "interleaved in one process; write results.json, results.md and plots.")
    bench.add_argument("--questions", required=True, metavar="FILE.jsonl",
                       help="Spec-Bench schema: question_id, category, turns (the first turn is used)")
    bench.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    bench.add_argument("--limit-per-category", type=int, default=5, metavar="N", help="default: 5")
    bench.add_argument("--drafters", default=None,
                       help="comma-separated; LABEL=DRAFTER runs DRAFTER under its own label, so one drafter can run "
                            "twice with different --drafter-option LABEL:KEY=VALUE (default: ngram,prompt-lookup)")
    bench.add_argument("--drafter-option", dest="drafter_options", action="append", type=parse_drafter_option,
                       default=[], metavar="DRAFTER:KEY=VALUE",
                       help="an option for one of the drafters, e.g. draft-model:model=DIR (repeatable)")
    bench.add_argument("--spec-length", type=int, default=None, metavar="K", help="default: 4")
    speculative_config_arg(bench, "the one drafter to run (with plain decoding), in place of --drafters, "
                                  "--spec-length and --drafter-option")
    bench.add_argument("--fixed-spec-length", action="store_true",
                       help="every drafter drafts K tokens every round instead of adapting to acceptance and "
                            "verify cost (to compare drafters' acceptance at one draft length)")
    bench.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default: 128")
    bench.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy; outputs are compared)")
    bench.add_argument("--repeats", type=int, default=1, metavar="R",
                       help="run the whole bench R times, each pass with fresh decoders, and keep each method's "
                            "median-time run of each prompt: per-category figures on a noisy shared machine "
                            "(default: 1)")
    bench.add_argument("--peers", default="",
                       help="comma-separated: 'hf' (transformers' generate and its prompt lookup), 'llama-cpp' "
                            "(llama.cpp on the target's GGUF file, as many threads as torch; needs "
                            "pip install 'specdraft[llama-cpp]')")
    bench.add_argument("--output", default="bench-out", metavar="DIR", help="default: bench-out")
    bench.add_argument("--target", default=None, help="as for generate (default: SmolLM2-135M-Instruct)")
    device_args(bench)

    dist = sub.add_parser("distill", help="train a compact draft model for a target from the target's own outputs",
                          description="Build a small draft (a few of the target's layers, its embeddings shared, "
                                      "a head over frequent tokens) and train it on the target's answers to the "
                                      "prompts; resumable. Use it with --drafter draft-model --drafter-option model=DIR.")
    dist.add_argument("--output", required=True, metavar="DIR", help="where the draft (and work/ files) go")
    dist.add_argument("--layers", type=int, default=2, help="decoder layers of the draft (default: 2)")
    dist.add_argument("--objective", choices=["kl", "ce"], default="kl",
                      help="kl: match the target's distributions (default); ce: its tokens")
    dist.add_argument("--work", default=None, metavar="DIR",
                      help="cache of the target's answers and states (default: DIR/work); train-heads can share it")
    dist.add_argument("--gate-steps", type=int, default=300,
                      help="steps of the copy gate's training, after the draft's (default: 300; 0: no copy gate: "
                           "the draft never copies from the context)")
    _training_args(dist, steps=300, steps_help="training steps", lr=5e-4, head_tokens_help="output-head vocabulary")

    th = sub.add_parser("train-heads", help="train Medusa, EAGLE, EAGLE-3 or MLP-speculator heads on a frozen target",
                        description="Train draft heads on the target's hidden states: phase 1 on prompts with "
                                    "reference answers (causal LM), phase 2 on the target's own answers (match its "
                                    "distributions), 5:2 in steps. Resumable; writes a loss plot.")
    th.add_argument("--kind", required=True, choices=["medusa", "eagle", "eagle3", "mlp-speculator"])
    th.add_argument("--output", required=True, metavar="DIR", help="where the heads go")
    th.add_argument("--work", default=None, metavar="DIR",
                    help="cache of the target's answers and hidden states (default: DIR/work); share it between kinds")
    th.add_argument("--num-texts", type=int, default=600, help="phase-1 examples with reference answers (default: 600)")
    th.add_argument("--num-heads", type=int, default=4, help="medusa heads / mlp-speculator stages (default: 4)")
    th.add_argument("--gate-steps", type=int, default=300,
                    help="steps of the copy gate's training, after the heads' (default: 300; 0: no copy gate: "
                         "the heads never copy from the context)")
    th.add_argument("--init", default=None, metavar="DIR",
                    help="start from these heads (specdraft's format, same kind) instead of fresh ones; with "
                         "--steps 0 only their copy gate is fitted")
    _training_args(th, steps=700, steps_help="training steps, split 5:2 between phases", lr=1e-3,
                   head_tokens_help="output vocabulary (eagle3: its draft vocabulary): the most frequent answer "
                                    "tokens; 0 = all")

    from .server.cli import add_serve_parser  # argparse only: FastAPI loads when `serve` runs

    add_serve_parser(sub)
    from .bench.serve_load import add_bench_serve_parser  # argparse only, like serve

    add_bench_serve_parser(sub)

    lst = sub.add_parser("drafters", help="list registered drafters and the plugins providing them")
    lst.add_argument("--json", action="store_true", help="print JSON")
    return parser


def format_runner(info: dict) -> str:
    """``{"implementation": ..., "compiled": ..., "quantization": ..., "dtype": ...}`` in a few words."""
    dtype = info.get("dtype")
    reason = f" ({info['dtype_reason']})" if info.get("dtype_reason") else ""
    return (f"{info['implementation']} model code, {'compiled' if info['compiled'] else 'eager'}, "
            f"{info['quantization'] or 'unquantized'} weights" + (f", {dtype}{reason}" if dtype else "")
            + (f", sharded over {info['tensor_parallel']} ranks" if info.get("tensor_parallel") else "")
            + _cuda_kernels(info.get("kernels")))


def _cuda_kernels(kernels) -> str:
    """``, CUDA kernels: ...`` from a runner's kernel report on CUDA (nothing elsewhere)."""
    if not isinstance(kernels, dict) or "cuda" not in kernels:
        return ""
    if kernels["cuda"] != "invariant":
        return f", CUDA kernels: {kernels.get('why', kernels['cuda'])}"
    linear = "/".join(sorted(kernels.get("linear", {}))) or "none"
    return (f", row-invariant CUDA kernels (linear {linear}, attention {kernels.get('attention')}, "
            f"RMSNorm {kernels.get('rms_norm')})")


def format_stats(stats, drafter: str, spec_length: int, runner: dict | None = None) -> str:
    by_pos = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position) or "-"
    return "\n".join([
        f"drafter: {drafter}  spec_length: {spec_length}"
        + (f"  target: {format_runner(runner)}" if runner else ""),
        f"new tokens: {stats.new_tokens}  time: {stats.total_time_s:.2f} s  tokens/s: {stats.tokens_per_second:.1f}",
        f"target passes: {stats.target_passes}  tokens per pass: {stats.tokens_per_pass:.2f}",
        f"drafted: {stats.drafted_tokens}  accepted: {stats.accepted_tokens}  acceptance rate: {stats.acceptance_rate:.3f}",
        f"rounds that drafted: {stats.drafts}  draft nodes per round: {stats.nodes_per_draft:.2f} "
        f"({sum(stats.drafted_per_position) / max(stats.drafts, 1):.2f} levels deep)  "
        f"accepted per round: {stats.accepted_per_draft:.2f}",
        f"acceptance by position (tree depth): {by_pos}",
        f"time split: prefill {stats.prefill_time_s:.2f} s, drafting {stats.draft_time_s:.2f} s, "
        f"verifying {stats.verify_time_s:.2f} s",
        f"prompt tokens: {stats.prompt_tokens}  from the prefix cache: {stats.cached_tokens}",
    ])


def _read_prompt(arg: str) -> str:
    """The prompt argument, or standard input for '-', as text; ConfigError unless valid UTF-8,
    or when it is longer than :data:`MAX_PROMPT_BYTES` (standard input is read no further)."""
    import os

    # argv as the shell passed it; standard input no further than the limit (+1, to see it is over)
    data = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1) if arg == "-" else os.fsencode(arg)
    if len(data) > MAX_PROMPT_BYTES:
        raise ConfigError(f"the prompt is longer than {MAX_PROMPT_BYTES >> 20} MiB, the most specdraft reads: far more "
                          "than a model's context holds; shorten it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the prompt is not valid UTF-8 (byte {data[exc.start]:#04x} at offset {exc.start}); "
                          "convert it first, for example with `iconv -f latin1 -t utf-8`") from None


def _read_prediction(path: str | None) -> str | None:
    """``--prediction FILE``'s text (None: no flag, or an empty file)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PROMPT_BYTES + 1)
        if len(data) > MAX_PROMPT_BYTES:
            raise ConfigError(f"--prediction {path}: it is longer than {MAX_PROMPT_BYTES >> 20} MiB, the most "
                              "specdraft reads: far more than a model's context holds; shorten it")
        return data.decode("utf-8") or None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prediction {path}: cannot read it as UTF-8 text ({exc.__class__.__name__}: {exc})") from None


def _check_fits(text: str, what: str, decoder) -> None:
    """Refuse ``text`` before it is tokenized when its length alone shows it is too long for the
    context (:func:`specdraft.limits.check_fits`; the bound is read only for a text with more
    characters than the context has tokens)."""
    from .limits import chars_per_token, check_fits

    context = decoder.target.max_context
    if decoder.tokenizer is not None and len(text) >= context:
        check_fits(text, what, chars_per_token(decoder.tokenizer), context)


def _generate(args) -> int:
    prompt = _read_prompt(args.prompt)
    if not prompt.strip():
        raise ConfigError("the prompt is empty; give some text to continue")
    prediction = _read_prediction(args.prediction)
    from .decoder import SpeculativeDecoder
    from .limits import check_spec_length
    from .plugins import get_registry
    from .settings import GenerationSettings

    # Cheap checks first, so a typo fails in a blink rather than after loading a model.
    resolve_drafter(args)
    check_spec_length(args.spec_length)
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens, seed=args.seed, stop=args.stop, prediction=prediction,
        ignore_eos=args.ignore_eos, min_tokens=args.min_tokens, stop_token_ids=args.stop_token_id,
        **{name: getattr(args, name) for name in SAMPLING_FLAGS})
    settings.check_ids()
    get_registry().validate_options(args.drafter, dict(args.drafter_options))
    settings = settings.replace(response_format=_response_format(args))
    decoder = SpeculativeDecoder.from_pretrained(
        target=args.target, drafter=args.drafter, spec_length=args.spec_length,
        drafter_options=dict(args.drafter_options), dtype=args.dtype, device=args.device,
        adaptive=not args.fixed_spec_length, compile=args.compile, quantize=args.quantize,
        tensor_parallel=args.tensor_parallel,
    )
    _check_fits(prompt, "the prompt", decoder)
    if prediction is not None:
        _check_fits(prediction, f"--prediction {args.prediction}", decoder)
    from .engine import GenerationInterrupted

    if args.stream:
        stream = decoder.stream(prompt, settings, raw=args.raw)
        try:
            for chunk in stream:
                print(chunk.text, end="", flush=True)
        except KeyboardInterrupt:  # Ctrl-C: what was printed stays
            stream.close()
            print(flush=True)
            print("specdraft: interrupted", file=sys.stderr)
            return 130
        print(flush=True)
        result = stream.result
    else:
        try:
            result = decoder.generate(prompt, settings, raw=args.raw)[0]
        except GenerationInterrupted as stopped:  # Ctrl-C: keep what was generated
            print(stopped.results[0].text, flush=True)
            print("specdraft: interrupted", file=sys.stderr)
            return 130
        print(result.text)
    if args.stats:
        print(format_stats(result.stats, decoder.drafter.name or args.drafter, args.spec_length, decoder.runner_info),
              file=sys.stderr)
    return 0


def _response_format(args):
    """``--response-format`` / ``--json-schema`` / ``--regex`` as a grammar (None: none), checked
    before any model loads: a file that cannot be read, bad JSON, a second flag, or a grammar
    without llguidance installed is one line and exit 2."""
    from .grammar import check_spec
    from .structured import from_cli

    spec = from_cli(args.response_format, args.json_schema, args.regex)
    if spec is not None:
        if args.ignore_eos:
            raise ConfigError(f"--ignore-eos cannot be combined with {spec.field}: the grammar ends the answer "
                              "once it is complete")
        check_spec(spec)  # llguidance installed, and the schema or regex valid
    return spec


def _drafters(args) -> int:
    from .plugins import get_registry

    registry = get_registry()
    rows = [
        {
            "name": spec.name,
            "aliases": list(spec.aliases),
            "plugin": spec.plugin,
            "options": list(spec.options.model_fields),
            "defaults": dict(spec.defaults),
        }
        for spec in registry.specs()
    ]
    problems = [{"plugin": p, "error": e} for p, e in registry.errors]
    problems += [
        {"plugin": " and ".join(owners), "error": f"drafter name {name!r} registered more than once"}
        for name, owners in registry.claims.items() if len(owners) > 1
    ]
    if args.json:
        print(json.dumps({"drafters": rows, "errors": problems}, indent=2))
    else:
        width = max((len(r["name"]) for r in rows), default=4)
        for r in rows:
            aliases = f" (aliases: {', '.join(r['aliases'])})" if r["aliases"] else ""
            options = ", ".join(r["options"]) or "-"
            print(f"{r['name']:<{width}}  plugin: {r['plugin']}{aliases}  options: {options}")
    for p in problems:
        print(f"warning: plugin {p['plugin']!r}: {p['error']}", file=sys.stderr)
    return 0


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def _gguf_of(target: str | None) -> str | None:
    """The GGUF file a target is loaded from (the default model's, or a .gguf --target), else None."""
    if target is None:
        from .models import default_gguf_path

        return str(default_gguf_path())
    return target if target.endswith(".gguf") else None


def _bench(args) -> int:
    from .bench import BenchSettings, load_questions, run_bench, write_outputs
    from .bench.harness import split_method
    from .limits import check_spec_length
    from .settings import GenerationSettings
    from .plugins import get_registry

    resolve_methods(args, "ngram,prompt-lookup")
    options: dict[str, dict[str, str]] = {}
    for drafter, key, value in args.drafter_options:
        options.setdefault(drafter, {})[key] = value
    methods = dict(split_method(d) for d in _split(args.drafters))  # label -> drafter
    unknown = sorted(set(options) - set(methods))
    if unknown:
        raise ConfigError(f"--drafter-option names {', '.join(unknown)}, which --drafters does not run "
                          f"({args.drafters}); add it to --drafters or drop the option")
    settings = BenchSettings(
        questions=args.questions, categories=_split(args.categories) or None,
        limit_per_category=args.limit_per_category, drafters=_split(args.drafters), spec_length=args.spec_length,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, peers=_split(args.peers),
        adaptive=not args.fixed_spec_length,
        drafter_options=options, gguf=_gguf_of(args.target), compile=args.compile, quantize=args.quantize,
        tensor_parallel=args.tensor_parallel, repeats=args.repeats,
    )
    check_spec_length(settings.spec_length)
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1 (got {args.repeats})")
    GenerationSettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature)
    if args.limit_per_category is not None and args.limit_per_category < 1:
        raise ConfigError("--limit-per-category must be >= 1")
    for label, drafter in methods.items():  # unknown names and bad options fail here, before the model loads
        get_registry().validate_options(drafter, options.get(label))
    load_questions(settings.questions, settings.categories, settings.limit_per_category)
    from .models import load_target

    model, tokenizer, name = load_target(args.target, dtype=args.dtype, device=args.device)
    from .bench.harness import BenchInterrupted

    try:
        records, summary, env = run_bench(model, tokenizer, settings, name=name)
    except BenchInterrupted as stopped:  # Ctrl-C: keep the prompts that finished for every method
        note = f"specdraft: bench interrupted after {stopped.finished} of {stopped.total} prompts"
        if not stopped.finished:  # nothing to show; leave an earlier run's results in --output alone
            print(f"{note}; nothing written", file=sys.stderr)
            return 130
        out = write_outputs(args.output, stopped.records, stopped.summary, stopped.env)
        print((out / "results.md").read_text())
        print(f"{note}; wrote their results.json, results.md and plots in {out}/", file=sys.stderr)
        return 130
    out = write_outputs(args.output, records, summary, env)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and plots in {out}/", file=sys.stderr)
    return 0


def _print_held_out(meta_file) -> None:
    held = json.loads(meta_file.read_text()).get("held_out") or {}
    if held.get("acceptance_by_position"):
        rates = " ".join(f"{a:.2f}" for a in held["acceptance_by_position"])
        print(f"greedy acceptance by position on {held['answers']} held-out answers of the target: {rates}")


def _distill(args) -> int:
    from .models import load_target
    from .training.distill import distill

    _check_training_args(args, "layers", "head_tokens", "steps")
    model, tokenizer, name = load_target(args.target, dtype=args.dtype, device=args.device)
    out = distill(model, tokenizer, name, args.prompts, args.output, num_prompts=args.num_prompts,
                  max_new_tokens=args.max_new_tokens, layers=args.layers, head_tokens=args.head_tokens,
                  steps=args.steps, batch_size=args.batch_size, lr=args.lr, objective=args.objective,
                  self_prompts=args.self_prompts, document_prompts=args.document_prompts,
                  work_dir=args.work, train_dtype=args.train_dtype, copy_gate=args.gate_steps > 0,
                  gate_steps=args.gate_steps, gen_batch_size=args.generate_batch_size, seed=args.seed)
    from .drafters.common.compact_draft import FORMAT_FILE

    _print_held_out(out / FORMAT_FILE)
    print(f"draft written to {out}; use it with: specdraft generate --drafter draft-model "
          f"--drafter-option model={out} ...")
    return 0


def _train_heads(args) -> int:
    from .models import load_target
    from .training.heads import train_heads

    if args.head_tokens < 0:
        raise ConfigError("--head-tokens must be >= 0 (0 = the whole vocabulary)")
    if args.init is not None and not Path(args.init).is_dir():
        raise ConfigError(f"--init {args.init!r} is not a folder; pass heads made by `specdraft train-heads`")
    _check_training_args(args, "num_texts", "num_heads", *(("steps",) if args.init is None else ()),
                         non_negative=("steps",))
    model, tokenizer, name = load_target(args.target, dtype=args.dtype, device=args.device)
    config = {"num_heads": args.num_heads} if args.kind == "medusa" else (
        {"num_stages": args.num_heads} if args.kind == "mlp-speculator" else {})
    out = train_heads(model, tokenizer, name, args.kind, args.prompts, args.output, num_texts=args.num_texts,
                      num_prompts=args.num_prompts, self_prompts=args.self_prompts,
                      document_prompts=args.document_prompts, max_new_tokens=args.max_new_tokens, steps=args.steps,
                      batch_size=args.batch_size, lr=args.lr, head_tokens=args.head_tokens or None,
                      work_dir=args.work, train_dtype=args.train_dtype, copy_gate=args.gate_steps > 0,
                      gate_steps=args.gate_steps, init_from=args.init, gen_batch_size=args.generate_batch_size,
                      seed=args.seed, **config)
    from .drafters.heads.formats import FORMAT_FILE

    _print_held_out(out / FORMAT_FILE)
    print(f"heads written to {out}; use them with: specdraft generate --drafter {args.kind} "
          f"--drafter-option heads={out} ...")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "tensor_parallel", 1) != 1:  # torchrun's ranks other than 0 follow rank 0, then end here
            from .runner.tp import follow_if_worker

            follow_if_worker(args.tensor_parallel, args.device)
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "distill":
            return _distill(args)
        if args.command == "train-heads":
            return _train_heads(args)
        if args.command == "serve":
            from .server.cli import serve

            return serve(args)
        if args.command == "bench-serve":
            from .bench.serve_load import bench_serve

            return bench_serve(args)
        return _drafters(args)
    except SpecdraftError as exc:
        print(f"specdraft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
