"""Weights shipped inside the package, found by the fingerprint of the target they were trained for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...types import TargetInfo

#: drafts and heads shipped in the package, trained with ``specdraft distill`` / ``train-heads``
SHIPPED = Path(__file__).parent.parent / "weights"  # specdraft/drafters/weights


def find_shipped(target: TargetInfo, meta_file: str, **match: Any) -> Path | None:
    """The shipped folder whose ``meta_file`` names this target's fingerprint (and ``match``'s values)."""
    from .compact_draft import target_fingerprint

    if target.embeddings is None or not SHIPPED.is_dir():
        return None
    fingerprint = target_fingerprint(target.embeddings.weight)
    for meta_path in sorted(SHIPPED.glob(f"*/{meta_file}")):
        meta = json.loads(meta_path.read_text())
        if meta.get("target_fingerprint") == fingerprint and all(meta.get(k) == v for k, v in match.items()):
            return meta_path.parent
    return None
