"""Weights shipped inside the package, found by the fingerprint of the target they were trained for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...types import TargetInfo

#: drafts and heads shipped in the package, trained with ``specdraft distill`` / ``train-heads``
SHIPPED = Path(__file__).parent.parent / "weights"  # specdraft/drafters/weights
#: the shipped weights files (path under SHIPPED, size, sha256, git blob): not in git's tracked
#: tree but in its history, written back by ``scripts/restore_weights.py``
MANIFEST = "MANIFEST.json"


def check_weights(folder: Path) -> None:
    """A one-line ConfigError when a weights file of the shipped ``folder`` is missing or not
    whole (a checkout whose weights were not restored from git's history)."""
    manifest = folder.parent / MANIFEST
    if not manifest.is_file():
        return
    for entry in json.loads(manifest.read_text())["files"]:
        path = folder.parent / entry["path"]
        if path.parent != folder:
            continue
        size = path.stat().st_size if path.is_file() else None
        if size != entry["size"]:
            state = "is missing" if size is None else f"is incomplete ({size} of {entry['size']} bytes)"
            raise ConfigError(f"the shipped weights file {path} {state}: run `python3 scripts/restore_weights.py` "
                              "(or `bash scripts/install.sh`) in specdraft's checkout to write it from git's history")


def find_shipped(target: TargetInfo, meta_file: str, **match: Any) -> Path | None:
    """The shipped folder whose ``meta_file`` names this target's fingerprint (and ``match``'s values);
    a ConfigError saying how to restore its weights when they are missing."""
    from .compact_draft import target_fingerprint

    if target.embeddings is None or not SHIPPED.is_dir():
        return None
    fingerprint = target_fingerprint(target.embeddings.weight)
    for meta_path in sorted(SHIPPED.glob(f"*/{meta_file}")):
        meta = json.loads(meta_path.read_text())
        if meta.get("target_fingerprint") == fingerprint and all(meta.get(k) == v for k, v in match.items()):
            check_weights(meta_path.parent)
            return meta_path.parent
    return None
