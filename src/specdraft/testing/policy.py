"""The draft-length policy in simulation: rounds against a drafter of known acceptance and known
costs, no model and no clock, so a policy's speedup can be set beside the best a fixed draft
length gets (``benchmarks/policy_sim.py`` prints the grid; ``tests/engine/test_policy.py``
bounds it).

A round asks the policy for a length k, draws how many of the k drafted tokens are accepted
(each position accepted with its probability, given the ones before it were), and tells the
policy what the round cost: a (k + 1)-token verify pass and k drafted tokens, in units of a
1-token pass. Acceptance can switch between two levels (text that copies its prompt for a
while, then does not).
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

#: verify-pass cost by width, in 1-token passes: a 2-core AVX2 CPU measured for the default model
#: (docs/benchmarks.md), a GPU where width is nearly free, and a slow CPU where each token costs a quarter
COSTS: dict[str, Callable[[int], float]] = {
    "cpu": lambda w: [1.0, 1.2, 1.22, 1.25, 1.27][w - 1] if w <= 5 else 1.27 + 0.05 * (w - 5),
    "gpu": lambda w: 1.0 + 0.02 * (w - 1),
    "slow": lambda w: 1.0 + 0.25 * (w - 1),
}


def best_fixed(acceptance: float, cost: Callable[[int], float], draft_cost: float, max_k: int = 4) -> float:
    """The speedup over plain steps of the best fixed draft length (0 included) for a drafter whose
    every position is accepted with probability ``acceptance``."""
    return max([1.0] + [sum(acceptance ** j for j in range(k + 1)) / (cost(k + 1) + draft_cost * k)
                        for k in range(1, max_k + 1)])


def simulate(policy, acceptance: Sequence[float], cost: Callable[[int], float], draft_cost: float,
             rounds: int = 1500, seed: int = 0, switch: float = 0.02) -> float:
    """The speedup over plain steps of ``policy`` (an AdaptiveDraftLength) over ``rounds`` rounds:
    tokens per unit of time, a plain step taking 1. ``acceptance``: one level, or two between which
    it switches with probability ``switch`` each round."""
    rng = random.Random(seed)
    tokens = time = 0.0
    level = 0
    for _ in range(rounds):
        if len(acceptance) > 1 and rng.random() < switch:
            level = 1 - level
        k = policy.choose()
        if k == 0:
            policy.observe(1, cost(1), [0], [0])
            tokens, time = tokens + 1, time + cost(1)
            continue
        accepted = 0
        while accepted < k and rng.random() < acceptance[level]:
            accepted += 1
        policy.observe(k + 1, cost(k + 1), [k], [accepted], draft_seconds=draft_cost * k)
        tokens, time = tokens + accepted + 1, time + cost(k + 1) + draft_cost * k
    return tokens / time


__all__ = ["COSTS", "best_fixed", "simulate"]
