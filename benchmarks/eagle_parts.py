"""Where EAGLE's drafting time goes, per call, inside real generation (wall clock, after a warm-up).

Wraps the drafter's parts with timers and generates for the first few Spec-Bench prompts
twice, reporting the second pass (the first loads kernels and measures the CPU fast path):

    python benchmarks/eagle_parts.py                 # CPU
    python benchmarks/eagle_parts.py --device cuda   # on a GPU every operation launched counts

On a GPU the timers synchronise nothing, so a part's time is what the host spent in it,
which is what a launch-bound step costs.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from specdraft import SpeculativeDecoder
from specdraft.bench.harness import load_questions
from specdraft.drafters.common import copy_gate
from specdraft.drafters.heads import drafters
from specdraft.models import load_target

PARTS = [(drafters.EagleDrafter, "propose", "propose (a whole round of drafting)"),
         (drafters.EagleDrafter, "step", "the decoder layer over its runner"),
         (drafters.HeadDrafter, "_draw", "head + copy candidate + choice"),
         (copy_gate.CopyDrafting, "choose", "copy gate's greedy choice")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--device", default=None)
    p.add_argument("--min-confidence", type=float, default=None)
    args = p.parse_args()
    seconds, calls = defaultdict(float), defaultdict(int)

    def timed(cls, name, label):
        original = getattr(cls, name)

        def run(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - start
                calls[label] += 1

        setattr(cls, name, run)

    for cls, name, label in PARTS:
        timed(cls, name, label)
    model, tokenizer, _ = load_target(None, device=args.device)
    options = {} if args.min_confidence is None else {"min_confidence": args.min_confidence}
    dec = SpeculativeDecoder(model, tokenizer, drafter="eagle", spec_length=4, drafter_options=options)
    prompts = [q["prompt"] for q in load_questions(args.questions)[: 2 * args.prompts : 2]]
    for _ in range(2):  # the first pass warms up
        seconds.clear(), calls.clear()
        start, tokens = time.perf_counter(), 0
        for text in prompts:
            tokens += dec.generate([text], max_new_tokens=96)[0].stats.new_tokens
    print(f"{tokens} tokens in {time.perf_counter() - start:.2f} s")
    for label in seconds:
        print(f"{label:40s} calls {calls[label]:5d}  {1e3 * seconds[label] / calls[label]:6.2f} ms a call")


if __name__ == "__main__":
    main()
