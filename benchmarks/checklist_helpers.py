"""Small helpers of ``benchmarks/gpu_checklist.sh`` (standard library only: they run before anything is set up).

    python3 benchmarks/checklist_helpers.py questions SRC.jsonl DEST.jsonl [CATEGORY ...]
        the first question of each CATEGORY in SRC (Spec-Bench's question.jsonl) into DEST
    python3 benchmarks/checklist_helpers.py drafters
        the built-in drafters that can run on the default model here, comma-separated: ngram,
        prompt-lookup and suffix (no weights), then each shipped drafter whose weights files are
        all here and whole (sizes as in the weights folder's MANIFEST.json)
    python3 benchmarks/checklist_helpers.py weights
        one line per shipped weights folder: its drafter and whether its files are here
    python3 benchmarks/checklist_helpers.py mismatches DIR
        one line: the drafters of a bench run (DIR/results.json) whose outputs differ from plain
        decoding's, and on how many prompts; exit 1 if any (peers such as hf-generate run other
        kernels: theirs are shown, not counted)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = Path(os.environ.get("CHECKLIST_WEIGHTS") or ROOT / "src" / "specdraft" / "drafters" / "weights")
#: bench methods that are not specdraft's speculation (their mismatches are other kernels' numerics)
PEERS = ("plain", "hf-generate", "hf-prompt-lookup", "llama-cpp")
#: Spec-Bench categories the checklist's subset takes one question of: the four of GPU.md, then two more
CATEGORIES = ("coding", "math_reasoning", "summarization", "writing", "rag", "translation")
#: drafters that need no weights
FREE = ("ngram", "prompt-lookup", "suffix")
#: the order shipped drafters run in
SHIPPED_ORDER = ("eagle", "eagle3", "medusa", "mlp-speculator", "draft-model")


def questions(src: str, dest: str, *categories: str) -> int:
    wanted = list(categories or CATEGORIES)
    picked: dict[str, str] = {}
    with open(src) as f:
        for line in f:
            if line.strip():
                category = json.loads(line).get("category")
                if category in wanted and category not in picked:
                    picked[category] = line.rstrip("\n")
    missing = [c for c in wanted if c not in picked]
    if missing:
        print(f"{src} has no question of categories {', '.join(missing)}", file=sys.stderr)
        return 1
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    Path(dest).write_text("".join(picked[c] + "\n" for c in wanted))
    print(f"{dest}: {len(wanted)} questions, one each of {', '.join(wanted)}")
    return 0


def shipped() -> list[tuple[str, str, list[str]]]:
    """``(folder, drafter, problems)`` per shipped weights folder; ``problems`` empty when its files are whole."""
    manifest = WEIGHTS / "MANIFEST.json"
    entries = json.loads(manifest.read_text())["files"] if manifest.is_file() else []
    out = []
    for folder in sorted(p for p in WEIGHTS.iterdir() if p.is_dir()) if WEIGHTS.is_dir() else []:
        if (folder / "specdraft_heads.json").is_file():
            drafter = json.loads((folder / "specdraft_heads.json").read_text()).get("kind", "?")
        elif (folder / "specdraft_draft.json").is_file():
            drafter = "draft-model"
        else:
            continue
        problems = []
        mine = [e for e in entries if Path(e["path"]).parts[0] == folder.name]
        for entry in mine:
            path = WEIGHTS / entry["path"]
            size = path.stat().st_size if path.is_file() else None
            if size != entry["size"]:
                state = "missing" if size is None else f"{size} of {entry['size']} bytes"
                problems.append(f"{entry['path']} {state}")
        if not mine and not any(p.stat().st_size for p in folder.glob("*.safetensors")):
            problems.append(f"{folder.name}: no weights file")
        out.append((folder.name, drafter, problems))
    return out


def drafters() -> int:
    present = {drafter for _, drafter, problems in shipped() if not problems}
    print(",".join(list(FREE) + [d for d in SHIPPED_ORDER if d in present]))
    return 0


def weights() -> int:
    for folder, drafter, problems in shipped():
        print(f"{drafter} ({folder}): " + ("here" if not problems else "absent: " + "; ".join(problems)))
    return 0


def mismatches(folder: str) -> int:
    path = Path(folder) / "results.json"
    if not path.is_file():
        print(f"mismatches vs plain: {path} is missing (the run did not finish)")
        return 1
    summary = json.loads(path.read_text())["summary"]
    differ, peers, counted = [], [], []
    for method, figures in summary.items():
        overall = figures.get("overall", {})
        n, prompts = overall.get("mismatches"), overall.get("prompts", "?")
        if method in PEERS:
            if n:
                peers.append(f"{method} {n} of {prompts}")
        else:
            counted.append(method)
            if n:
                differ.append(f"{method} {n} of {prompts}")
    line = ("mismatches vs plain: NOT EXACT: " + ", ".join(differ)) if differ else \
        f"mismatches vs plain: none ({len(counted)} drafters: {', '.join(counted)})"
    if peers:
        line += f"; peers (other kernels, not counted): {', '.join(peers)}"
    print(line)
    return 1 if differ else 0


def main(argv: list[str]) -> int:
    commands = {"questions": questions, "drafters": drafters, "weights": weights, "mismatches": mismatches}
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[argv[0]](*argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
