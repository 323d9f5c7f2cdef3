"""The target's KV cache memory with requests that reserve far more than they use: what the rows
take at their peak, against what a row per ``--max-batch`` slot as long as the longest reservation
(specdraft before ``--kv-cache-memory``) would take; and under a bound that fits two reservations,
how many requests run at once and whether every output equals the unbounded run's.

    python benchmarks/kv_memory.py
    python benchmarks/kv_memory.py --requests 8 --max-tokens 1024 --target FOLDER

The requests are Self-Instruct's user-oriented instructions (never Spec-Bench), chat-templated,
greedy, each allowed ``--max-tokens`` and most ending well before. The figures are memory and
counts, not time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdraft import SpeculativeDecoder

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "self_instruct" / "user_oriented_instructions.jsonl"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _run(decoder, prompts, max_tokens):
    cache, peak = decoder.runner.cache, {"bytes": 0, "running": 0, "sum": 0, "reports": 0}

    def watch(report):
        peak["bytes"] = max(peak["bytes"], cache.nbytes)
        peak["running"] = max(peak["running"], len(decoder.engine.scheduler.running))
        peak["sum"] += cache.nbytes
        peak["reports"] += 1

    stop = decoder.observe(watch)
    results = decoder.generate(prompts, max_new_tokens=max_tokens)  # chat-templated
    stop()
    return results, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="the model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default="prompt-lookup")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--data", default=str(DATA))
    args = p.parse_args()
    rows = [json.loads(line) for line in open(args.data)][: args.requests]
    prompts = [r["instruction"] + ("\n\n" + r["instances"][0]["input"] if r["instances"][0]["input"] else "")
               for r in rows]
    free = SpeculativeDecoder.from_pretrained(args.target, drafter=args.drafter, max_batch=args.requests,
                                              prefix_caching=False)
    results, peak = _run(free, prompts, args.max_tokens)
    cache, memory = free.runner.cache, free.engine.memory
    reservation = max(r.stats.prompt_tokens for r in results) + args.max_tokens + memory.widest + 1
    before = cache.bytes_for(args.requests, reservation)  # a row per slot, each the longest reservation
    used = [len(r.token_ids) for r in results]
    print(f"{args.requests} requests, max_tokens {args.max_tokens}, output tokens {min(used)}-{max(used)} "
          f"(mean {sum(used) / len(used):.0f}); {cache.token_bytes} bytes per token position")
    mean = peak["sum"] / max(1, peak["reports"])
    print(f"| rows' memory | peak | mean over the engine's reports |\n|---|---|---|\n"
          f"| a row per slot, each the longest reservation | {_mib(before)} | {_mib(before)} |\n"
          f"| by use (this run, unbounded: 4 GiB) | {_mib(peak['bytes'])} | {_mib(mean)} |")
    budget = cache.bytes_for(2, reservation)
    bounded = SpeculativeDecoder.from_pretrained(args.target, drafter=args.drafter, max_batch=args.requests,
                                                 prefix_caching=False, kv_cache_memory=budget)
    again, peak2 = _run(bounded, prompts, args.max_tokens)
    same = sum(a.token_ids == b.token_ids for a, b in zip(results, again))
    print(f"bound {_mib(budget)} (two reservations): at most {peak2['running']} running at once, peak "
          f"{_mib(peak2['bytes'])}, {same}/{len(results)} outputs equal to the unbounded run's")


if __name__ == "__main__":
    main()
