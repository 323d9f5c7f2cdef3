"""Kernel launches and time of one decode step (and one verify pass) of a real model shape, random weights.

Builds the default model's shape (SmolLM2-135M-Instruct: ``--shape default``) or Llama-3.2-1B/3B's
(``llama-1b``, ``llama-3b``) with random weights (no file needed, as ``llama_pair_costs.py``
does), loads it through specdraft's runner and prints, for a one-token step and a ``--verify``-token
pass over a cache of ``--context`` tokens: the median time, the weight-read floor (the model's
weight bytes over the device's measured read bandwidth), and, on CUDA, what ``torch.profiler``
records in one pass: GPU kernel events (memcpy and memset included), the CPU's kernel-launch
calls and CUDA-graph launches. A step of many small kernels is bound by their launches, not by
reading the weights; CUDA graphs (``--compile``) replay them in one launch.

    python benchmarks/launch_counts.py --device cuda --dtype bfloat16
    python benchmarks/launch_counts.py --device cuda --dtype bfloat16 --compile
    SPECDRAFT_CUDA_KERNELS=stock python benchmarks/launch_counts.py --device cuda   # cuBLAS/SDPA
"""

from __future__ import annotations

import argparse
import collections

import torch

from llama_pair_costs import named_config, random_model, read_bandwidth, time_pass, weight_bytes  # beside this file
from row_invariance import compact
from specdraft.runner import load_runner


def profile_pass(runner, width, context, device):
    """``(GPU kernel events, CPU launch calls, graph launches, top kernels)`` of one ``width``-token pass
    (on a CPU: the top-level aten operators as "kernels", no launches)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    runner.cache.reset(1, context + 64)
    vocab = runner.model.config.get_text_config().vocab_size if hasattr(runner.model, "config") else \
        runner.model.args.vocab_size
    ids = torch.randint(0, vocab, (1, context + 64), device=device)
    with torch.inference_mode():
        runner.forward(ids[:, :context])
        for i in range(3):  # warm-up: compiles, captures, autotunes outside the profile
            runner.cache.set_lengths([context + i])
            runner.forward(ids[:, context + i:context + i + width])
        sync()
        runner.cache.set_lengths([context + 3])
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            runner.forward(ids[:, context + 3:context + 3 + width])
            sync()
    gpu, launches, graphs = collections.Counter(), 0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA or (
                not cuda and e.name.startswith("aten::") and e.cpu_parent is None):
            gpu[e.name] += 1
        elif "LaunchKernel" in e.name:  # cudaLaunchKernel(ExC), and Triton's cuLaunchKernel(Ex)
            launches += 1
        elif "GraphLaunch" in e.name:  # cudaGraphLaunch, cuGraphLaunch
            graphs += 1
    return sum(gpu.values()), launches, graphs, gpu.most_common(4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["default", "llama-1b", "llama-3b"], default="default")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="torch.compile (+ CUDA graphs on CUDA)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--verify", type=int, default=5, help="tokens of the verify pass (K+1; default 5)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: torch {torch.__version__} sees no CUDA device here", flush=True)
        return 2
    torch.manual_seed(0)
    cfg = named_config(args.shape, args.layers)
    runner = load_runner(random_model(cfg, getattr(torch, args.dtype), device), compile=args.compile)
    floor = weight_bytes(runner) / read_bandwidth(device)
    mode = "CUDA graphs" if getattr(runner, "cuda_graphs", False) else ("compiled" if args.compile else "eager")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.shape} shape ({cfg.num_hidden_layers} layers), {args.dtype}, {mode}, {name}, context {args.context}; "
          f"kernels: {compact(runner.info.get('kernels'))}")
    for width in (1, args.verify):
        t = time_pass(runner, width, args.context, args.reps, device)
        line = f"- {width}-token pass: {t * 1e3:.2f} ms, {t / floor:.1f}x the weight-read floor ({floor * 1e3:.3f} ms)"
        kernels, launches, graphs, top = profile_pass(runner, width, args.context, device)
        if device.type == "cuda":
            line += f"; {kernels} GPU kernel events, {launches} kernel-launch calls, {graphs} graph launches"
        else:
            line += f"; {kernels} top-level aten operators (CPU)"
        line += "; most frequent: " + ", ".join(f"{n[:40]} x{c}" for n, c in top)
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
