"""What an n-token verify pass of a real target costs relative to a 1-token pass, on this machine.

The adaptive draft length measures this as it runs; this script prints it as a table, for
docs/benchmarks.md or to see why drafting does (not) pay on a given processor:

    python benchmarks/verify_costs.py                      # the default model, float32, CPU
    python benchmarks/verify_costs.py --target DIR --context 56 769 --widths 1 2 3 4 5

It runs specdraft's model runner (``--compile``, ``--quantize int8`` as for ``specdraft generate``)
with the timing loop of ``llama_pair_costs.py``: every timed pass starts one token further along,
as in decoding. It also prints the 1-token pass's weight-read floor (weight bytes over the
measured read bandwidth).
"""

from __future__ import annotations

import argparse

from llama_pair_costs import read_bandwidth, time_pass, weight_bytes

from specdraft.models import load_target
from specdraft.runner import load_runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="as for specdraft generate (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--context", type=int, nargs="+", default=[56, 769], help="tokens already in the cache")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--quantize", choices=["int8", "int4"], default=None)
    args = p.parse_args()
    model, _, name = load_target(args.target, dtype=args.dtype, device=args.device)
    device = model.device
    widths = sorted(set(args.widths) | {1})
    runner = load_runner(model, compile=args.compile, quantize=args.quantize)
    floor = weight_bytes(runner) / read_bandwidth(device)
    print(f"{name}, {model.dtype}, {device}, runner {runner.info}: an n-token pass relative to a 1-token pass; "
          f"weight-read floor of a step {floor * 1000:.1f} ms\n")
    print("| context | 1-token pass | " + " | ".join(f"n={w}" for w in widths if w > 1) + " |")
    print("|---|---|" + "---|" * (len(widths) - 1))
    for context in args.context:
        seconds = {w: time_pass(runner, w, context, args.reps, device) for w in widths}
        cells = " | ".join(f"{seconds[w] / seconds[1]:.2f}" for w in widths if w > 1)
        print(f"| {context} tokens | {seconds[1] * 1000:.1f} ms | {cells} |")


if __name__ == "__main__":
    main()
