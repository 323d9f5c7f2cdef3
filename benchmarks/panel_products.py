"""The products of one SmolLM2-135M decode step on CPU: oneDNN (PackedLinear) against the panels of
specdraft_cpu::linear (PanelLinear), at several row counts, in one process.

The 121 products of a step (30 layers of q/k/v, output, gate/up and down, then the 49152-row head)
with distinct random weights, so the weights stream from memory as in a real step. The two kernels
alternate, seven times per row count; the table shows the best and the median time of a whole step's
products:

    python benchmarks/panel_products.py                         # float32, 1..256 rows
    python benchmarks/panel_products.py --dtype bfloat16 --rows 1 5 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from specdraft.runner import cpu_ops
from specdraft.runner.kernels import PackedLinear, checked_row_counts, one_row_checked

#: (inputs, outputs) of one layer's products, and the head
LAYER = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
HEAD = (576, 49152)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16, 32, 64, 256])
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    reason = cpu_ops.load()
    if reason:
        raise SystemExit(f"no C++ operators here: {reason}")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    shapes = LAYER * 30 + [HEAD]
    linears = [nn.Linear(i, o, bias=False).to(dtype) for i, o in shapes]
    packed = []
    for linear in linears:
        module = PackedLinear(linear)
        module.counts, module.one_row = checked_row_counts(module), one_row_checked(module)
        packed.append(module)
    panels = [cpu_ops.PanelLinear(linear) for linear in linears]
    print(f"{args.dtype}, {torch.get_num_threads()} threads; oneDNN runs one row alone: {packed[0].one_row}")
    print("| rows | oneDNN: best (median) ms | panels: best (median) ms | oneDNN / panels |")
    print("|---|---|---|---|")
    for rows in args.rows:
        xs = {i: torch.randn(rows, i).to(dtype) for i in {s[0] for s in shapes}}
        times: dict[str, list[float]] = {"oneDNN": [], "panels": []}
        with torch.inference_mode():
            for _ in range(args.reps):
                for label, modules in (("oneDNN", packed), ("panels", panels)):
                    start = time.perf_counter()
                    for (i, _), module in zip(shapes, modules):
                        module(xs[i])
                    times[label].append(time.perf_counter() - start)
        a, b = times["oneDNN"], times["panels"]
        print(f"| {rows} | {min(a) * 1e3:.1f} ({statistics.median(a) * 1e3:.1f}) | "
              f"{min(b) * 1e3:.1f} ({statistics.median(b) * 1e3:.1f}) | {min(a) / min(b):.2f} |", flush=True)


if __name__ == "__main__":
    main()
