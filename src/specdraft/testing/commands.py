"""How tests start the real ``specdraft`` command in a fresh process."""

from __future__ import annotations

import sys
from pathlib import Path


def specdraft_command() -> list[str]:
    """The installed ``specdraft`` script beside this interpreter, else ``python -m specdraft.cli``."""
    script = Path(sys.executable).with_name("specdraft")
    return [str(script)] if script.exists() else [sys.executable, "-m", "specdraft.cli"]


__all__ = ["specdraft_command"]
