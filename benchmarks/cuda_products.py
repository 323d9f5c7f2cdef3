"""Decode products on a GPU against the device's read bandwidth: each Triton product of
``specdraft.runner.cuda_kernels`` (``tiles``: :func:`triton_linear`, the default; ``split``:
:func:`split_linear`, ``SPECDRAFT_CUDA_LINEAR=split``) and cuBLAS, on the products of a named
shape's decoder layer and its head (fused QKV, attention's output, fused gate/up, down, LM head).

For each product and width (rows in the pass) it times a CUDA graph of one call on each of enough
distinct copies of the weight to pass the L2 cache (each read cold, as in a step), and prints
microseconds per call, GB/s of weight read, and that rate over the device's (``read_bandwidth``
of ``llama_pair_costs.py``): the share of a step's floor each product reaches. It also checks
that each Triton product's rows equal one-row calls at the widths timed (what the load-time check
asks). The same inputs go to every kernel; nothing here chooses a kernel at run time.

    python benchmarks/cuda_products.py --shape llama-3b --widths 1,5
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from llama_pair_costs import NAMED_SHAPES, read_bandwidth, sync  # noqa: E402

from specdraft.runner import cuda_kernels as ck  # noqa: E402

KERNELS = {"tiles": ck.triton_linear, "split": ck.split_linear, "cublas": F.linear}


def products(shape: str) -> dict[str, tuple[int, int]]:
    """``name -> (out, in)`` of the shape's decode products."""
    (hidden, _, heads, kv, inter), overrides = NAMED_SHAPES[shape]
    dim = hidden // heads
    vocab = overrides.get("vocab_size", 128256)
    return {"qkv": ((heads + 2 * kv) * dim, hidden), "o": (hidden, heads * dim), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "head": (vocab, hidden)}


def time_product(kernel, x, weights, reps: int) -> float:
    """Seconds per call: a CUDA graph of one call per weight copy, replayed ``reps`` times."""
    for w in weights:  # compile the kernel before the capture
        kernel(x, w)
    sync(x.device)
    if x.device.type != "cuda":
        import time

        start = time.perf_counter()
        for _ in range(reps):
            for w in weights:
                kernel(x, w)
        return (time.perf_counter() - start) / (reps * len(weights))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                kernel(x, w)
    graph.replay()
    sync(x.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    sync(x.device)
    return start.elapsed_time(end) / 1e3 / (reps * len(weights))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3b", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--widths", default="1,5")
    parser.add_argument("--kernels", default="tiles,split,cublas")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cold-mb", type=int, default=512, help="weight copies per product add up to at least this")
    parser.add_argument("--only", default="", help="products to run (comma-separated names), default all")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    widths = [int(w) for w in args.widths.split(",")]
    kernels = args.kernels.split(",")
    bandwidth = read_bandwidth(device)
    print(f"{args.shape}, {args.dtype}, {device}: read bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("| product | out x in | split | width | " + " | ".join(f"{k} us (GB/s, of bandwidth)" for k in kernels)
          + " | rows invariant |")
    print("|---|---|---|---|" + "---|" * len(kernels) + "---|")
    generator = torch.Generator(device=device).manual_seed(0)
    (hidden, layers, *_), _ = NAMED_SHAPES[args.shape]
    step = {k: {w: 0.0 for w in widths} for k in kernels}  # seconds of a step's products at these rates
    for name, (out, inner) in products(args.shape).items():
        if args.only and name not in args.only.split(","):
            continue
        size = out * inner * dtype.itemsize
        copies = max(1, -(-args.cold_mb * 2**20 // size))
        weights = [torch.randn(out, inner, generator=generator, device=device).to(dtype) for _ in range(copies)]
        x_all = torch.randn(max(widths), inner, generator=generator, device=device).to(dtype)
        with torch.inference_mode():
            for width in widths:
                x, cells, same = x_all[:width].contiguous(), [], []
                for k in kernels:
                    seconds = time_product(KERNELS[k], x, weights, args.reps)
                    step[k][width] += seconds * (1 if name == "head" else layers)
                    rate = size / seconds
                    cells.append(f"{seconds * 1e6:.1f} ({rate / 1e9:.0f}, {rate / bandwidth:.2f})")
                    if k != "cublas":
                        alone = torch.cat([KERNELS[k](x[i:i + 1], weights[0]) for i in range(width)])
                        same.append(f"{k} {'yes' if torch.equal(KERNELS[k](x, weights[0]), alone) else 'NO'}")
                print(f"| {name} | {out} x {inner} | {ck.split_of(out, inner)} | {width} | " + " | ".join(cells)
                      + f" | {', '.join(same)} |")
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.only:  # a step's products: the layers' and the head's
        weights = sum(o * i * (1 if n == "head" else layers) for n, (o, i) in products(args.shape).items())
        floor = weights * dtype.itemsize / bandwidth
        print(f"\na step's products ({layers} layers and the head) at these rates, against the "
              f"{floor * 1e3:.3f} ms floor of reading them:")
        for width in widths:
            print(f"- width {width}: " + ", ".join(f"{k} {step[k][width] * 1e3:.3f} ms ({step[k][width] / floor:.2f}x)"
                                                 for k in kernels))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
