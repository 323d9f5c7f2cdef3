"""The shipped draft model's step cost against the target's (issue 43's ``c``), beside their weight ratio.

Loads the default model with ``--drafter draft-model``'s shipped draft, then times one-token steps
of each runner after ``--context`` positions, alternating ``--rounds`` times in one process (median
and best of ``--reps`` steps each), and prints ``c`` = draft step / target step next to the ratio
of the bytes a step of each reads (``llama_pair_costs.weight_bytes``: every weight but the input
embedding). A draft whose step costs what its weights cost has ``c`` equal to that ratio.

    python benchmarks/draft_cost.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from llama_pair_costs import weight_bytes  # noqa: E402

from specdraft import SpeculativeDecoder  # noqa: E402


def step_time(runner, context: int, reps: int) -> tuple[float, float]:
    """(median, best) seconds of a one-token step after ``context`` positions."""
    runner.cache.reset(1, context + 64)
    ids = torch.randint(0, 7000, (1, context + 1), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        runner.forward(ids[:, :context])
        for _ in range(reps):
            runner.cache.set_lengths([context])
            start = time.perf_counter()
            runner.forward(ids[:, context:context + 1])
            times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="the target's dtype (default: the device's)")
    args = parser.parse_args()
    dec = SpeculativeDecoder.from_pretrained(drafter="draft-model", dtype=args.dtype)
    target, draft = dec.runner, dec.drafter.runner
    ratio = weight_bytes(draft) / weight_bytes(target)
    print(f"weights a step reads: target {weight_bytes(target) / 1e6:.1f} MB, draft {weight_bytes(draft) / 1e6:.1f} MB, "
          f"ratio {ratio:.3f}")
    for _ in range(args.rounds):
        (tm, tb), (dm, db) = step_time(target, args.context, args.reps), step_time(draft, args.context, args.reps)
        print(f"target {tm * 1e3:.2f} ms (best {tb * 1e3:.2f}), draft {dm * 1e3:.2f} ms (best {db * 1e3:.2f}): "
              f"c = {dm / tm:.3f} (best {db / tb:.3f}), {dm / tm / ratio:.2f}x the weight ratio")


if __name__ == "__main__":
    main()
