"""Whether a runner's passes are row-invariant on this machine, and what its products cost by row count.

Exact speculative decoding needs a verify pass of W tokens to give each token, bit for bit, the
logits W one-token steps give it (``specdraft.runner.kernels``). This prints, for ``--device`` and
each ``--dtype``:

* the model: the widths (``--widths``, default 1..16) at which a pass over three rows of ragged
  lengths (and over a subset of them) differs from one-token steps (none, if the runner is
  row-invariant there); widths past the runner's decode width (prefill, which is never compared
  with one-token steps) are reported apart;
* ``--shape``: the model itself (``gguf``, the default: ``--target`` or the default model's GGUF),
  or random weights in a real model's shape, which needs no model file: ``default``
  (SmolLM2-135M-Instruct's), ``llama-1b`` or ``llama-3b`` (Llama-3.2's, as
  ``llama_pair_costs.py`` builds them); ``--layers N`` keeps the first N layers (a quick check);
* ``--kernels``: for each linear shape of the model, the row counts at which ``F.linear`` and the
  runner's packed kernel are not bit-identical to a one-row product, and their times at 1, 2, 5
  and 16 rows (the measurements behind the fixed rule in ``specdraft.runner.kernels``).

    python benchmarks/row_invariance.py                              # the default model, CPU
    python benchmarks/row_invariance.py --device cuda --dtype bfloat16 float32
    python benchmarks/row_invariance.py --shape llama-3b --device cuda --dtype bfloat16 --compile
    python benchmarks/row_invariance.py --shape default --layers 2 --widths 1-16,24,32
    python benchmarks/row_invariance.py --kernels --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.nn.functional as F

from specdraft.models import load_target
from specdraft.runner import load_runner
from specdraft.runner.kernels import PackedLinear, packable
from specdraft.testing import differing_widths


def _time(fn, device) -> float:
    fn()
    best = float("inf")
    for _ in range(20):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def kernel_table(model, dtype, device) -> None:
    """Per linear shape of ``model``: row counts (2..48) where each kernel's rows differ from one-row products."""
    shapes = {}
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            shapes.setdefault(tuple(module.weight.shape), module)
    print("| shape (out x in) | kernel | rows not bit-identical to 1 row | 1 | 2 | 5 | 16 rows (ms) |")
    print("|---|---|---|---|---|---|---|")
    for (out, inner), module in shapes.items():
        linear = torch.nn.Linear(inner, out, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(module.weight.to(dtype))
        kernels = {"F.linear": lambda x: F.linear(x, linear.weight)}
        if packable(linear):
            packed = PackedLinear(linear)
            kernels["packed (specdraft)"] = packed
        x = torch.randn(48, inner, device=device).to(dtype)
        for name, fn in kernels.items():
            with torch.inference_mode():
                alone = torch.cat([fn(x[i:i + 1]) for i in range(48)])
                bad = [n for n in range(2, 49) if not torch.equal(fn(x[:n]), alone[:n])]
                times = [_time(lambda n=n: fn(x[:n]), device) * 1000 for n in (1, 2, 5, 16)]
            shown = "none" if not bad else ", ".join(map(str, bad[:6])) + (" ..." if len(bad) > 6 else "")
            print(f"| {out} x {inner} | {name} | {shown} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


def parse_widths(text: str) -> list[int]:
    """``"1-16,24,32"`` -> ``[1, ..., 16, 24, 32]`` (sorted, without repeats)."""
    widths: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        widths.update(range(int(low), int(high or low) + 1))
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"widths must be positive, as in 1-16,24,32 (got {text!r})")
    return sorted(widths)


def spans(widths) -> str:
    """``[2, 3, 4, 7]`` -> ``"2-4,7"``."""
    out, run = [], []
    for w in widths:
        if run and w != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(w)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "none"


def compact(kernels) -> str:
    """The runner's kernel report on one line: per-layer entries (``layers.N.*``) counted by value."""
    if not isinstance(kernels, dict):
        return str(kernels)
    shown, layers = {}, {}
    for key, value in kernels.items():
        if str(key).startswith("layers."):
            layers[value] = layers.get(value, 0) + 1
        else:
            shown[key] = value
    if layers:
        shown["per-layer entries (value: count)"] = layers
    return str(shown)


def load(args, dtype):
    """``(model, name, vocab size)``: the model of ``--target`` / the default GGUF, or random weights of ``--shape``."""
    if args.shape == "gguf":
        model, _, name = load_target(args.target, dtype=dtype, device=args.device)
        if args.layers is not None:  # keep the first N decoder layers
            model.model.layers = model.model.layers[:args.layers]
            model.config.num_hidden_layers = args.layers
            name += f" (its first {args.layers} layers)"
        return model, name, model.config.vocab_size
    from llama_pair_costs import named_config, random_model  # beside this file

    if args.target is not None:
        raise SystemExit("--target goes with --shape gguf only")
    cfg = named_config(args.shape, args.layers)
    torch.manual_seed(0)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = random_model(cfg, getattr(torch, dtype), device)
    name = f"{args.shape} shape, random weights, {cfg.num_hidden_layers} layers"
    return model, name, cfg.vocab_size


_LAST = {"kernels": None}


def report(name, runner, widths, bad_all, bad_subset, decode_width, timing) -> bool:
    """Print one line for a setting; True when a decode width (not prefill) differs."""
    decode = [w for w in widths if w <= decode_width]
    wide = [w for w in widths if w > decode_width]
    bad = sorted(set(bad_all + bad_subset))
    bad_decode = [w for w in bad if w <= decode_width]
    if not bad_decode:
        verdict = f"row-invariant at widths {spans(decode)}"
    else:
        verdict = (f"NOT row-invariant: all rows differ at {spans([w for w in bad_all if w <= decode_width])}, "
                   f"the subset at {spans([w for w in bad_subset if w <= decode_width])} (of {spans(decode)})")
    if wide:  # prefill widths: reported, not required
        differ = [w for w in bad if w > decode_width]
        verdict += f"; prefill widths {spans(wide)} (> {decode_width}, not required): " + \
            (f"differ at {spans(differ)}" if differ else "same")
    kernels = runner.info.get("kernels", getattr(runner.model, "kernels", None))
    mode = ("CUDA graphs" if getattr(runner, "cuda_graphs", False) else "compiled") if runner.compiled else "eager"
    dtype = str(runner.dtype).removeprefix("torch.")
    shown = compact(kernels)
    if shown == _LAST["kernels"]:  # the same as the line above: said once
        shown = "as above"
    else:
        _LAST["kernels"] = shown
    print(f"{name} | {dtype} | {mode} | {runner.device} | kernels: {shown} | {verdict} | {timing}", flush=True)
    return bool(bad_decode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="as for specdraft generate (default: SmolLM2-135M-Instruct)")
    p.add_argument("--shape", choices=["gguf", "default", "llama-1b", "llama-3b"], default="gguf",
                   help="gguf: the model itself (--target, default the default model's GGUF); else random weights "
                        "of the default model's (SmolLM2-135M's) or Llama-3.2-1B/3B's shape, no file needed")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile (+ CUDA graphs on CUDA); --modes runs several in one process")
    p.add_argument("--modes", nargs="+", choices=["eager", "compile"], default=None,
                   help="eager and/or compile, each dtype's model shared by both (default: per --compile)")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None)
    p.add_argument("--widths", type=parse_widths, default=list(range(1, 17)), metavar="SPEC",
                   help="pass widths to compare with one-token steps, e.g. 1-16,24,32 (default: 1-16)")
    p.add_argument("--kernels", action="store_true", help="also the per-shape kernel table")
    args = p.parse_args()
    if args.device is not None and torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device here")
    from specdraft.runner.model import CUDA_DECODE_WIDTH, DECODE_WIDTH  # wider passes are prefill

    on_cuda = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    decode_width = CUDA_DECODE_WIDTH if on_cuda else DECODE_WIDTH
    modes = args.modes or (["compile"] if args.compile else ["eager"])
    failed = False
    for dtype in args.dtype:
        start = time.perf_counter()
        model, name, vocab = load(args, dtype)
        loaded = time.perf_counter() - start
        for mode in modes:  # runners of one model share its converted weights
            start = time.perf_counter()
            runner = load_runner(model, compile=mode == "compile", quantize=args.quantize)
            built = time.perf_counter() - start
            bad_all, bad_subset = differing_widths(runner, vocab, args.widths, prompt_lengths=(37, 20, 51))
            checked = time.perf_counter() - start - built
            compiling = f" (compiling {runner.compile_seconds:.1f} s)" if getattr(runner, "compile_seconds", 0) else ""
            failed |= report(name, runner, args.widths, bad_all, bad_subset, decode_width,
                             f"model {loaded:.1f} s, runner {built:.1f} s, check {checked:.1f} s{compiling}")
            if args.kernels:
                print()
                kernel_table(model, runner.dtype, model.device)
            del runner
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
