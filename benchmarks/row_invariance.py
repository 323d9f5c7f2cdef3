"""Whether a runner's passes are row-invariant on this machine, and what its products cost by row count.

Exact speculative decoding needs a verify pass of W tokens to give each token, bit for bit, the
logits W one-token steps give it (``specdraft.runner.kernels``). This prints, for ``--device`` and
each ``--dtype``:

* the model: the widths 1..16 at which a pass over three rows of ragged lengths (and over a subset
  of them) differs from one-token steps (none, if the runner is row-invariant there);
* ``--kernels``: for each linear shape of the model, the row counts at which ``F.linear`` and the
  runner's packed kernel are not bit-identical to a one-row product, and their times at 1, 2, 5
  and 16 rows (the measurements behind the fixed rule in ``specdraft.runner.kernels``).

    python benchmarks/row_invariance.py                              # the default model, CPU
    python benchmarks/row_invariance.py --device cuda --dtype bfloat16 float32
    python benchmarks/row_invariance.py --kernels --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="as for specdraft generate (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--quantize", choices=["int8", "int4"], default=None)
    p.add_argument("--kernels", action="store_true", help="also the per-shape kernel table")
    args = p.parse_args()
    widths = list(range(1, 17))
    for dtype in args.dtype:
        model, _, name = load_target(args.target, dtype=dtype, device=args.device)
        runner = load_runner(model, compile=args.compile, quantize=args.quantize)
        bad_all, bad_subset = differing_widths(runner, model.config.vocab_size, widths, prompt_lengths=(37, 20, 51))
        verdict = "row-invariant" if not bad_all and not bad_subset else "NOT row-invariant"
        print(f"\n{name}, {runner.dtype}, {model.device}, {runner.info}, threads {torch.get_num_threads()}: "
              f"{verdict} at widths 1..16 (differing widths: all rows {bad_all or 'none'}, "
              f"a subset of rows {bad_subset or 'none'}); packed kernels: {getattr(runner.model, 'kernels', None)}")
        if args.kernels:
            print()
            kernel_table(model, runner.dtype, model.device)


if __name__ == "__main__":
    main()
