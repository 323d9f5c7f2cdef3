"""What a drafter costs in the rounds it does not draft: each drafter's decoder runs plain rounds
only (never asked for a draft), beside the ``none`` drafter's, in one process, prompt by prompt in
alternating order, and the decode time per token is given relative to ``none``'s.

A drafter whose policy stops drafting where its guesses are rarely accepted (a category of
Spec-Bench, say) runs at this ratio at best: anything above 1.00 is a floor under its speedup
there. The hidden states a verify pass returns for it, what it does with them each round and
whatever else its hooks do all count; drafting does not. Time is the engine's decode time
(prefill excluded). Greedy, so every decoder's output is the same; the script checks it.

    python benchmarks/idle_rounds.py --drafters eagle3,eagle,medusa,mlp-speculator,draft-model,ngram
"""

from __future__ import annotations

import argparse
import collections
import json

import specdraft

#: Spec-Bench's prompts, from the checkout's root (as in the README's bench command)
QUESTIONS = "../shared/data/spec_bench/question.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", default="eagle3,eagle,medusa,mlp-speculator,draft-model,ngram")
    parser.add_argument("--questions", default=QUESTIONS, help="Spec-Bench's question.jsonl (one prompt per category)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts, the order reversed each pass")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    prompts: dict[str, str] = {}
    for line in open(args.questions):
        q = json.loads(line)
        prompts.setdefault(q["category"], q["turns"][0])
    names = ["none"] + [n for n in args.drafters.split(",") if n and n != "none"]
    decoders = {}
    for name in names:
        decoder = specdraft.SpeculativeDecoder.from_pretrained(drafter=name)
        decoder.engine.adaptive, decoder.engine.spec_length = False, 0  # never asked for a draft
        decoder.generate("Hello", max_new_tokens=8)  # warm-up
        decoders[name] = decoder
    per_token: dict[str, float] = collections.defaultdict(float)
    for rep in range(args.repeats):
        for prompt in prompts.values():
            outputs = set()
            for name in names if rep % 2 == 0 else names[::-1]:
                result = decoders[name].generate(prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True)[0]
                outputs.add(tuple(result.token_ids))
                per_token[name] += (result.stats.total_time_s - result.stats.prefill_time_s) / len(result.token_ids)
            assert len(outputs) == 1, "greedy decoders disagreed"
    print(f"{len(prompts)} prompts x {args.repeats} passes, {args.max_new_tokens} tokens each; "
          f"decode time per token relative to none (plain rounds only):")
    print("| drafter | vs none |\n|---|---|")
    for name in names:
        print(f"| {name} | {per_token[name] / per_token['none']:.3f} |")


if __name__ == "__main__":
    main()
