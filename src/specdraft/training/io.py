"""Files training writes and reads back: one atomic write, caches keyed by what built them.

Every checkpoint and cache file goes through :func:`write_atomic`, so a kill at any moment
leaves either the old file or the new one, never a torn one. Caches record the key of the
inputs that built them (:func:`key_of`); :func:`read_cache` reuses one only when the key
matches, and says which it did.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

from ..errors import SpecdraftError
from ..files import file_sha256, write_atomic  # the training modules import them from here


class DamagedFileError(SpecdraftError):
    """A checkpoint cannot be read back (truncated, corrupted, or from another program)."""


def key_of(inputs: Any) -> str:
    """A short hash of JSON-able ``inputs``: the key of what they build."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def changes(old: dict, new: dict) -> str:
    """What differs between two input records, e.g. ``max_new_tokens 8 -> 12, prompt_files``."""
    def readable(v) -> bool:  # numbers and short words, not hashes
        return isinstance(v, (int, float, bool, type(None))) or (
            isinstance(v, str) and len(v) <= 24 and not re.fullmatch(r"[0-9a-f]{16,}", v))

    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a != b:
            out.append(f"{k} {a} -> {b}" if readable(a) and readable(b) else k)
    return ", ".join(out) or "format"


def say(message: str, progress: bool = True) -> None:
    """One line about what training does with its files (on stderr, like the progress bars)."""
    if progress:
        print(message, file=sys.stderr, flush=True)


def _load_json(path: Path) -> tuple[str, dict, Any]:
    saved = json.loads(path.read_text(encoding="utf-8"))
    return saved["key"], saved["inputs"], saved["data"]


def read_cache(path: Path, inputs: dict, what: str, progress: bool = True,
               load: Callable[[Path], tuple[str, dict, Any]] = _load_json) -> Any | None:
    """The data cached in ``path`` if it was built from ``inputs``, else None.

    ``load(path) -> (key, inputs, data)`` reads it (default: JSON written by :func:`write_cache`).
    Says which: reusing it, rebuilding because the inputs changed (and which), or rebuilding
    because the file is damaged (a cache is rebuilt, never trusted, when it cannot be read).
    """
    if not path.is_file():
        return None
    key = key_of(inputs)
    try:
        old_key, old_inputs, data = load(path)
    except Exception as exc:  # noqa: BLE001 - whatever the reader raises, the file is not usable
        say(f"{path} is damaged or from an older specdraft ({type(exc).__name__}): rebuilding {what}", progress)
        return None
    if old_key != key:
        say(f"inputs changed ({changes(old_inputs, inputs)}): rebuilding {what} in {path}", progress)
        return None
    say(f"reusing cached {what} (key {key}) from {path}", progress)
    return data


def write_cache(path: Path, inputs: dict, data: Any) -> None:
    """Cache JSON-able ``data`` built from ``inputs`` in ``path`` (atomically)."""
    write_atomic(path, json.dumps({"key": key_of(inputs), "inputs": inputs, "data": data}))


__all__ = ["DamagedFileError", "changes", "file_sha256", "key_of", "read_cache", "say", "write_atomic",
           "write_cache"]
