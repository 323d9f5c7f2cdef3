"""The draft-length policy against an earlier one: each drafter runs twice in one ``specdraft
bench``, once with this checkout's policy and once, as ``DRAFTER@REV``, with the policy of git
revision ``REV`` (``src/specdraft/engine/policy.py`` as it was there), on the same prompts,
interleaved per prompt, greedy outputs checked equal to plain decoding's:

    python benchmarks/policy_ab.py --against HEAD~1 --drafters eagle3,draft-model
    python benchmarks/policy_ab.py --against 9fce404 --repeats 2 --output bench-policy

Writes the bench's results.json and results.md (every category's speedup for both) to
``--output`` and prints the latter.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
from pathlib import Path

from specdraft.bench import harness
from specdraft.models import load_target

#: Spec-Bench's prompts, from the checkout's root (as in the README's bench command)
QUESTIONS = "../shared/data/spec_bench/question.jsonl"
POLICY = "src/specdraft/engine/policy.py"


def policy_at(rev: str):
    """The AdaptiveDraftLength class of :data:`POLICY` at git revision ``rev``."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{rev}:{POLICY}"], cwd=root, capture_output=True, text=True, check=True)
    path = Path(tempfile.mkdtemp()) / "policy_at_rev.py"
    path.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location(f"policy_at_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AdaptiveDraftLength


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default="HEAD", help="the git revision whose policy runs beside this checkout's")
    p.add_argument("--drafters", default="eagle3,medusa,mlp-speculator,draft-model")
    p.add_argument("--questions", default=QUESTIONS)
    p.add_argument("--limit-per-category", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--output", default="bench-policy-ab")
    args = p.parse_args()
    earlier = policy_at(args.against)
    drafters = [d for d in args.drafters.split(",") if d]
    entries = [x for d in drafters for x in (d, f"{d}@{args.against}={d}")]
    made = harness._Methods._decoders

    def decoders(self):  # the earlier policy for the DRAFTER@REV decoders
        out = made(self)
        for label, decoder in out.items():
            if label.endswith(f"@{args.against}"):
                decoder.engine.policy_class = earlier
        return out

    harness._Methods._decoders = decoders
    model, tokenizer, name = load_target(None)
    settings = harness.BenchSettings(questions=args.questions, limit_per_category=args.limit_per_category,
                                     drafters=entries, repeats=args.repeats)
    records, summary, env = harness.run_bench(model, tokenizer, settings, name)
    env["policies"] = f"DRAFTER: this checkout's; DRAFTER@{args.against}: {POLICY} at {args.against}"
    out = harness.write_outputs(args.output, records, summary, env)
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
