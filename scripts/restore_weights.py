#!/usr/bin/env python3
"""Write the shipped drafters' weights into src/specdraft/drafters/weights/ from git's history.

The weights (62 MB of .safetensors) are not in the tracked tree, so that a checkout stays small
enough to send to a GPU machine; they are in main's history, which every full clone has.
src/specdraft/drafters/weights/MANIFEST.json lists each file: its path under that folder, size,
sha256, git blob id and a commit that holds it. For each file missing or different on disk this
script writes it from ``git cat-file blob ID`` and checks its size and sha256; files already right
are left alone, so running it again is quick. ``bash scripts/install.sh`` runs it.

    python3 scripts/restore_weights.py              restore what is missing or wrong
    python3 scripts/restore_weights.py --check      only say what is missing or wrong (exit 1 if any)
    python3 scripts/restore_weights.py --target DIR write into DIR instead (tests, other copies)
    python3 scripts/restore_weights.py --record     after shipping a new weights file: put it in
        the manifest. Commit the file first (git add -f PATH; git commit), then run --record and
        commit MANIFEST.json, then `git rm --cached PATH` (the folder's *.safetensors are ignored).

Standard library only. Exit status 0 when every file is (now) right, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = ROOT / "src" / "specdraft" / "drafters" / "weights"
MANIFEST = WEIGHTS / "MANIFEST.json"
CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def git(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=check, **kwargs)


def git_state() -> str | None:
    """None when ROOT is a git checkout; otherwise why not, as advice."""
    try:
        done = git("rev-parse", "--git-dir", check=False, capture_output=True, text=True)
    except FileNotFoundError:
        return "git is not installed here; install git, or copy the weights from a full clone of specdraft"
    if done.returncode != 0:
        return (f"{ROOT} is not a git checkout; clone specdraft's repository (a full clone, not --depth) and run "
                "this script there, or copy the weights folder from such a clone")
    return None


def missing_blob_advice() -> str:
    shallow = git("rev-parse", "--is-shallow-repository", check=False, capture_output=True, text=True)
    if shallow.stdout.strip() == "true":
        return "this clone is shallow: run `git fetch --unshallow` (the weights are in main's history), then run this again"
    return ("this clone lacks main's history that holds them: run `git fetch origin main` (or clone the repository "
            "again, without --depth or --filter), then run this again")


def problem(path: Path, entry: dict) -> str | None:
    """What is wrong with ``path`` as ``entry``'s file, or None when it is right."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{size} bytes, not {entry['size']}"
    if sha256_of(path) != entry["sha256"]:
        return "sha256 differs"
    return None


def restore(path: Path, entry: dict) -> str | None:
    """Write ``entry``'s blob to ``path`` (atomically); None, or why it could not."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            done = git("cat-file", "blob", entry["blob"], stdout=out, stderr=subprocess.PIPE, check=False)
        if done.returncode != 0:
            return f"git has no blob {entry['blob']} (from commit {entry['commit'][:12]})"
        wrong = problem(Path(tmp), entry)
        if wrong:
            return f"git's blob {entry['blob']} gives a file that is wrong ({wrong})"
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def record(target: Path) -> int:
    """Add or update the manifest's entries for the .safetensors under ``target`` (each must be in git)."""
    if (why := git_state()) is not None:
        print(f"restore_weights: {why}", file=sys.stderr)
        return 1
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.is_file() else {"files": []}
    entries = {e["path"]: e for e in manifest["files"]}
    failed = 0
    for path in sorted(target.glob("*/*.safetensors")):
        rel = path.relative_to(target).as_posix()
        blob = git("hash-object", str(path), capture_output=True, text=True).stdout.strip()
        commit = git("log", "-1", "--format=%H", f"--find-object={blob}", "HEAD",
                     capture_output=True, text=True).stdout.strip()
        if not commit:
            print(f"restore_weights: {rel} is in no commit of HEAD's history: commit it first "
                  f"(git add -f {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}; git commit)",
                  file=sys.stderr)
            failed += 1
            continue
        entries[rel] = {"path": rel, "size": path.stat().st_size, "sha256": sha256_of(path), "blob": blob,
                        "commit": commit}
        print(f"recorded {rel} ({entries[rel]['size']} bytes, blob {blob[:12]}, commit {commit[:12]})")
    manifest["files"] = [entries[k] for k in sorted(entries)]
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=WEIGHTS, help="folder to write into (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="only say what is missing or wrong")
    parser.add_argument("--record", action="store_true", help="put the folder's .safetensors in the manifest")
    args = parser.parse_args(argv)
    if args.record:
        return record(args.target)
    entries = json.loads(MANIFEST.read_text())["files"]
    todo = [(e, args.target / e["path"], why) for e in entries
            if (why := problem(args.target / e["path"], e)) is not None]
    if not todo:
        print(f"shipped weights: all {len(entries)} files present in {args.target}")
        return 0
    if args.check:
        for entry, _, why in todo:
            print(f"shipped weights: {entry['path']}: {why}", file=sys.stderr)
        print("restore them with: python3 scripts/restore_weights.py", file=sys.stderr)
        return 1
    if (why := git_state()) is not None:
        names = ", ".join(e["path"] for e, _, _ in todo)
        print(f"restore_weights: cannot restore {names}: {why}", file=sys.stderr)
        return 1
    failed, no_blob = 0, False
    for entry, path, why in todo:
        error = restore(path, entry)
        if error:
            print(f"restore_weights: {entry['path']} ({why}): {error}", file=sys.stderr)
            failed += 1
            no_blob = no_blob or error.startswith("git has no blob")
        else:
            print(f"shipped weights: restored {entry['path']} ({entry['size']} bytes) from git")
    if no_blob:
        print(f"restore_weights: {missing_blob_advice()}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
