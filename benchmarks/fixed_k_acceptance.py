"""Tokens per target pass when every round drafts K tokens (no adaptive length, no confidence stop).

That is the most a chain drafter can give if drafting and wider verify passes cost
nothing: its speedup ceiling. ``specdraft bench`` measures real speed with the policy on;
this measures what the policy is choosing from:

    python benchmarks/fixed_k_acceptance.py                       # eagle, mlp-speculator, medusa, prompt-lookup
    python benchmarks/fixed_k_acceptance.py --drafters eagle --spec-length 6 --limit-per-category 5

Acceptance by position is P(draft i accepted): every round drafts every position (prompt
lookup only where it finds a match), so it is not conditional on the positions before.
"""

from __future__ import annotations

import argparse

from specdraft import SpeculativeDecoder
from specdraft.bench.harness import load_questions
from specdraft.models import load_target

LEARNT = ("eagle", "mlp-speculator", "medusa", "draft-model")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    p.add_argument("--limit-per-category", type=int, default=2)
    p.add_argument("--drafters", default="eagle,mlp-speculator,medusa,prompt-lookup")
    p.add_argument("--spec-length", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--target", default=None)
    p.add_argument("--device", default=None)
    args = p.parse_args()

    prompts = [q["prompt"] for q in load_questions(args.questions, limit_per_category=args.limit_per_category)]
    model, tokenizer, name = load_target(args.target, device=args.device)
    k = args.spec_length
    print(f"{name}, {len(prompts)} prompts, K = {k}, every round drafts K tokens")
    for drafter in args.drafters.split(","):
        options = {"min_confidence": 0} if drafter in LEARNT else {}
        dec = SpeculativeDecoder(model, tokenizer, drafter=drafter, spec_length=k, adaptive=False,
                                 drafter_options=options)
        new = passes = 0
        drafted, accepted = [0] * k, [0] * k
        for text in prompts:
            stats = dec.generate([text], max_new_tokens=args.max_new_tokens)[0].stats
            new, passes = new + stats.new_tokens, passes + stats.target_passes
            for i, (d, a) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
                drafted[i], accepted[i] = drafted[i] + d, accepted[i] + a
        by_position = " / ".join(f"{a / d:.2f}" if d else "-" for a, d in zip(accepted, drafted))
        print(f"{drafter}: tokens/pass {new / passes:.2f}; P(draft i accepted) {by_position}", flush=True)


if __name__ == "__main__":
    main()
