"""EAGLE's draft layer and head right after a target step, and again at once (wall clock).

A drafting round starts right after a verify pass, which has read every target weight (269 MB
for the default model) and so pushed the draft's own weights out of the caches; this times one
call of the layer and one of the head there ("cold"), then each again ("hot", their weights
just read), over ``--rounds`` target steps, and prints the medians:

    python benchmarks/eagle_cold.py

On a machine whose last-level cache other tenants share, both figures move from run to run;
compare only within one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdraft import SpeculativeDecoder
from specdraft.models import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--context", type=int, default=200, help="target positions before each step")
    args = p.parse_args()
    model, tokenizer, _ = load_target(None)
    dec = SpeculativeDecoder(model, tokenizer, drafter="eagle", spec_length=4)
    dec.generate(["Write a short poem about the sea."], max_new_tokens=16)  # builds and warms both
    drafter, runner = dec.drafter, dec.runner
    runner.cache.reserve(args.context + 8, rows=1)
    feature = torch.randn(1, 1, drafter.target.hidden_size, dtype=drafter.target.dtype)
    token, target_token = torch.tensor([[42]]), torch.tensor([[1234]])
    times = {k: [] for k in ("target step", "layer cold", "head cold", "layer hot", "head hot")}
    for _ in range(args.rounds):
        runner.cache.set_lengths([args.context], slots=[0])
        start = time.perf_counter()
        runner.forward(target_token, slots=[0])
        times["target step"].append(time.perf_counter() - start)
        for kind in ("cold", "hot"):
            drafter.runner.cache.set_lengths([50], slots=[0])
            start = time.perf_counter()
            drafter.step(feature, token, [0])
            times[f"layer {kind}"].append(time.perf_counter() - start)
            start = time.perf_counter()
            drafter.head.small(feature[:, 0])
            times[f"head {kind}"].append(time.perf_counter() - start)
    skip = min(20, args.rounds // 10)  # the first rounds warm up
    for name, values in times.items():
        print(f"{name:12s} {1e3 * statistics.median(values[skip:]):6.3f} ms (median of {len(values) - skip})")


if __name__ == "__main__":
    main()
