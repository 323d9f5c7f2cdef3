"""A decode step of the default model on CPU: time against the weight-read floor, and operators per layer.

Compares what can run a decoder layer's glue and attention on CPU, each in its own process (the
choice is made when a model loads), interleaved ``--rounds`` times so that a busy moment of the
machine does not favour one of them:

    cpp       the C++ operators of specdraft.runner.cpu_ops (the default where they build)
    onednn    the same with oneDNN's products instead of the panels (SPECDRAFT_CPU_PRODUCTS=onednn)
    torch     torch's operators (SPECDRAFT_CPU_OPS=torch: what runs without a compiler)
    compiled  torch's operators, each block compiled by inductor's C++ backend (compile=True), the
              products and attention as opaque operators in the graph

For each: the median and best time of a one-token step and of a 5-token pass after ``--context``
tokens (bfloat16 where the CPU has native bfloat16 products), the weight-read floor (weight
bytes over the best read bandwidth seen: a sum over 1 GiB, or a one-row panel product over a 1 GiB
weight where that reads faster: llama_pair_costs.read_bandwidth), and the operators a one-token step dispatches per
layer and in all that do work (views not counted; eager only: dynamo refuses a dispatch mode; "one call"
where every layer runs in one operator).

    python benchmarks/cpu_step.py                       # all four, 3 rounds
    python benchmarks/cpu_step.py --modes cpp torch --rounds 5
    python benchmarks/cpu_step.py --modes cpp --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = {"cpp": ({}, False), "onednn": ({"SPECDRAFT_CPU_PRODUCTS": "onednn"}, False),
         "torch": ({"SPECDRAFT_CPU_OPS": "torch"}, False), "compiled": ({"SPECDRAFT_CPU_OPS": "torch"}, True)}


def measure(mode: str, context: int, reps: int, dtype: str | None = None) -> dict:
    """One mode in this process: times (seconds), floor, operators per layer."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from llama_pair_costs import read_bandwidth  # beside this file
    from specdraft.models import load_target
    from specdraft.runner import load_runner

    model, _, _ = load_target(None, dtype=dtype)
    runner = load_runner(model, compile=MODES[mode][1])
    args = runner.model.args
    packed = sum(m.nbytes for m in runner.model.modules() if hasattr(m, "nbytes"))  # the products, the head's too
    weight = packed + sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters() if "norm" in n)
    floor = weight / read_bandwidth(torch.device("cpu"))
    ids = torch.randint(0, args.vocab_size, (1, context + 64), generator=torch.Generator().manual_seed(0))
    runner.cache.reset(1, context + 64)
    out = {"mode": mode, "dtype": str(runner.dtype).removeprefix("torch."), "kernels": runner.info["kernels"].get(
        "cpu_ops", "-"), "floor_s": floor, "weight_bytes": weight}
    with torch.inference_mode():
        runner.forward(ids[:, :context])
        for width in (1, 5):
            times = []
            for i in range(reps + 3):
                runner.cache.set_lengths([context + i % 4])
                start = time.perf_counter()
                runner.forward(ids[:, context:context + width])
                if i >= 3:  # warm-up (compiles) first
                    times.append(time.perf_counter() - start)
            out[f"w{width}_median_s"], out[f"w{width}_best_s"] = statistics.median(times), min(times)
        if not MODES[mode][1]:  # the step's operators, and those inside the decoder blocks (hooks switch that on)
            class Count(TorchDispatchMode):
                def __init__(self):
                    super().__init__()
                    self.work, self.step, self.on, self.in_python = collections.Counter(), collections.Counter(), False, False

                def __torch_dispatch__(self, func, types, a=(), kw=None):
                    r = func._schema.returns
                    if not (r and all(x.alias_info is not None and not x.alias_info.is_write for x in r)):
                        self.step[str(func.overloadpacket)] += 1
                        if self.on:
                            self.work[str(func.overloadpacket)] += 1
                    return func(*a, **(kw or {}))

            def enter(*_):
                count.on = count.in_python = True

            count = Count()
            hooks = [h for block in runner.model.layers for h in (
                block.register_forward_pre_hook(enter),
                block.register_forward_hook(lambda *_: setattr(count, "on", False)))]
            runner.cache.set_lengths([context])
            with count:
                runner.forward(ids[:, context:context + 1])
            for h in hooks:
                h.remove()
            out["ops_per_step"] = sum(count.step.values())
            # every layer in one operator (specdraft_cpu::decoder_layers): no block is called from Python
            out["ops_per_layer"] = round(sum(count.work.values()) / args.n_layers, 1) if count.in_python else "one call"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=3, help="processes per mode, interleaved (default: 3)")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", default=None, help="the model's dtype (default: the CPU default, specdraft.models.default_dtype)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this mode, print JSON
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.context, args.reps, args.dtype)))
        return 0
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            env = {**os.environ, **MODES[mode][0]}
            proc = subprocess.run([sys.executable, __file__, "--one", mode, "--context", str(args.context), "--reps",
                                   str(args.reps)] + (["--dtype", args.dtype] if args.dtype else []), env=env,
                                  capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            results[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {mode}: {results[mode][-1]['w1_median_s'] * 1e3:.1f} ms", file=sys.stderr)
    first = next(iter(results.values()))[0]
    floor = statistics.median(x["floor_s"] for xs in results.values() for x in xs)
    print(f"default model, {first['dtype']}, context {args.context}, {args.rounds} processes per mode, "
          f"{args.reps} steps each; weight-read floor {floor * 1e3:.1f} ms ({first['weight_bytes'] / 1e6:.0f} MB)")
    print("| mode | operators per layer | a step's | 1-token step: median (best) | vs floor | 5-token pass: median (best) |")
    print("|---|---|---|---|---|---|")
    for mode, xs in results.items():
        w1 = statistics.median(x["w1_median_s"] for x in xs)
        w1b = min(x["w1_best_s"] for x in xs)
        w5 = statistics.median(x["w5_median_s"] for x in xs)
        w5b = min(x["w5_best_s"] for x in xs)
        ops, step_ops = xs[0].get("ops_per_layer", "-"), xs[0].get("ops_per_step", "-")
        print(f"| {mode} | {ops} | {step_ops} | {w1 * 1e3:.1f} ms ({w1b * 1e3:.1f}) | {w1 / floor:.2f}x | "
              f"{w5 * 1e3:.1f} ms ({w5b * 1e3:.1f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
