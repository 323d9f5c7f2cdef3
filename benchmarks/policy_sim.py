"""The draft-length policy in simulation (specdraft.testing.policy): its speedup over plain decoding
beside the best fixed draft length's, for simulated drafters of known acceptance and costs, no
model and no clock; with ``--against REV`` the policy of git revision REV beside it:

    python benchmarks/policy_sim.py
    python benchmarks/policy_sim.py --against 9fce404 --seeds 3

Each cell: this policy's speedup / (REV's) / the best fixed length's. Rows: a verify-cost curve
(cpu: the 2-core AVX2 EPYC's for the default model, 1.2 steps for 2 tokens; gpu: width nearly
free; slow: a quarter of a step per token) and drafting's cost per token in plain steps;
columns: the acceptance rate of every position, or two rates it switches between (2% a round; the
best there is the mean of each rate's best, an oracle that knows when it switches).
"""

from __future__ import annotations

import argparse
import statistics

from policy_ab import policy_at  # beside this file

from specdraft.engine.policy import AdaptiveDraftLength
from specdraft.testing.policy import COSTS, best_fixed, simulate

LEVELS = [(0.1,), (0.2,), (0.3,), (0.4,), (0.5,), (0.6,), (0.7,), (0.8,), (0.9,), (0.2, 0.8), (0.1, 0.6)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default=None, help="a git revision whose policy runs beside this checkout's")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1500)
    args = p.parse_args()
    policies = {"this": AdaptiveDraftLength, **({args.against: policy_at(args.against)} if args.against else {})}
    print("| cost | drafting | " + " | ".join("/".join(map(str, a)) for a in LEVELS) + " |")
    print("|---|---|" + "---|" * len(LEVELS))
    below = {name: 0 for name in policies}
    for cost in COSTS:
        for draft in (0.0, 0.05, 0.15, 0.3):
            cells = []
            for levels in LEVELS:
                got = {name: statistics.mean(simulate(cls(4), levels, COSTS[cost], draft, args.rounds, seed)
                                             for seed in range(args.seeds)) for name, cls in policies.items()}
                for name, s in got.items():
                    below[name] += s < 0.98
                best = statistics.mean(best_fixed(a, COSTS[cost], draft) for a in levels)
                cells.append(" / ".join(f"{s:.2f}" for s in got.values()) + f" / {best:.2f}")
            print(f"| {cost} | {draft} | " + " | ".join(cells) + " |")
    print("\ncells below 0.98x plain: " + ", ".join(f"{name} {n}" for name, n in below.items()))


if __name__ == "__main__":
    main()
