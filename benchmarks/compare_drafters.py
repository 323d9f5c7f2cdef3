"""Side-by-side tokens/s of plain decoding and drafters on Spec-Bench prompts, in one process.

    .venv/bin/python benchmarks/compare_drafters.py ../shared/data/spec_bench/question.jsonl \
        --categories summarization,coding,qa --drafters none,ngram,prompt-lookup

Takes the first question of each category (first turn), runs every drafter on it in turn
after one uncounted warm-up, and checks each greedy output against plain decoding.
"""

from __future__ import annotations

import argparse
import json

import specdraft
from specdraft.models import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("questions")
    ap.add_argument("--categories", default="summarization,coding,qa")
    ap.add_argument("--drafters", default="none,ngram,prompt-lookup")
    ap.add_argument("--spec-length", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()

    first: dict[str, str] = {}
    for line in open(args.questions):
        q = json.loads(line)
        first.setdefault(q["category"], q["turns"][0])
    model, tokenizer, _ = load_target(None)
    decoders = {d: specdraft.SpeculativeDecoder(model, tokenizer, drafter=d, spec_length=args.spec_length)
                for d in args.drafters.split(",")}
    decoders["none"].generate("Warm up.", max_new_tokens=8)
    print(f"{'category':14} {'drafter':14} {'prompt':>6} {'new':>4} {'tok/s':>6} {'vs plain':>8} "
          f"{'accept':>6} {'tok/pass':>8} same-as-plain")
    for category in args.categories.split(","):
        plain = None
        for name, dec in decoders.items():
            r = dec.generate(first[category], max_new_tokens=args.max_new_tokens)[0]
            s = r.stats
            plain = plain or r
            print(f"{category:14} {name:14} {s.prompt_tokens:6d} {s.new_tokens:4d} {s.tokens_per_second:6.1f} "
                  f"{s.tokens_per_second / plain.stats.tokens_per_second:7.2f}x {s.acceptance_rate:6.2f} "
                  f"{s.tokens_per_pass:8.2f} {r.token_ids == plain.token_ids}")


if __name__ == "__main__":
    main()
