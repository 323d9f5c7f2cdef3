"""Tokens per target pass of each drafter's chain and tree with the draft length and tree budget
fixed (``adaptive=False``): what the trees can give where a wide pass costs about what a narrow one
does (a GPU), independent of this machine's cost curve. Counts only; no timing.

    .venv/bin/python benchmarks/tree_tokens_per_pass.py ../shared/data/spec_bench/question.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from specdraft import SpeculativeDecoder
from specdraft.models import load_target

RUNS = {  # label: (drafter, options, the chain it is compared with)
    "eagle": ("eagle", {}, "eagle"),
    "eagle-tree": ("eagle", {"tree_budget": 16, "tree_width": 3}, "eagle"),
    "medusa": ("medusa", {}, "medusa"),
    "medusa-tree": ("medusa", {"tree_budget": 16, "tree_width": 3}, "medusa"),
    "prompt-lookup": ("prompt-lookup", {}, "prompt-lookup"),
    "pl-tree": ("prompt-lookup", {"tree_budget": 8, "tree_width": 3}, "prompt-lookup"),
    # min_confidence 0: no node dropped for its own probability (the default 0.2 drops most second guesses)
    "eagle-mc0": ("eagle", {"min_confidence": 0.0}, "eagle-mc0"),
    "eagle-tree-mc0": ("eagle", {"tree_budget": 16, "tree_width": 3, "min_confidence": 0.0}, "eagle-mc0"),
    "medusa-mc0": ("medusa", {"min_confidence": 0.0}, "medusa-mc0"),
    "medusa-tree-mc0": ("medusa", {"tree_budget": 16, "tree_width": 3, "min_confidence": 0.0}, "medusa-mc0"),
}


def main(questions: str, per_category: int = 2, max_new_tokens: int = 128) -> None:
    taken: dict[str, int] = defaultdict(int)
    prompts = []
    for line in open(questions):
        q = json.loads(line)
        if taken[q["category"]] < per_category:
            taken[q["category"]] += 1
            prompts.append(q["turns"][0])
    model, tokenizer, _ = load_target(None, dtype="float32")
    plain = None
    print(f"{len(prompts)} prompts, {max_new_tokens} new tokens, spec_length 4, adaptive off")
    print("| method | tokens/pass | nodes/round | accepted/round | vs its chain |")
    print("|---|---|---|---|---|")
    chain = {}
    for label, (drafter, options, compared) in RUNS.items():
        dec = SpeculativeDecoder(model, tokenizer, drafter=drafter, spec_length=4, adaptive=False,
                                 drafter_options=options)
        results = dec.generate(prompts, max_new_tokens=max_new_tokens)
        dec.close()
        tokens = [r.token_ids for r in results]
        if plain is None:
            plain = SpeculativeDecoder(model, tokenizer, drafter="none").generate(prompts, max_new_tokens=max_new_tokens)
        mismatches = sum(t != p.token_ids for t, p in zip(tokens, plain))
        new = sum(r.stats.new_tokens for r in results)
        passes = sum(r.stats.target_passes for r in results)
        drafts = max(1, sum(r.stats.drafts for r in results))
        per_pass = new / passes
        chain[label] = per_pass
        base = chain[compared]
        print(f"| {label} | {per_pass:.2f} | {sum(r.stats.drafted_tokens for r in results) / drafts:.2f} | "
              f"{sum(r.stats.accepted_tokens for r in results) / drafts:.2f} | {per_pass / base:.2f}x |"
              + (f" {mismatches} mismatches" if mismatches else ""))


if __name__ == "__main__":
    main(sys.argv[1])
