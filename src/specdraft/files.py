"""Writing files so a crash never leaves a torn one, and knowing files by their content."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable


def write_atomic(path: str | Path, data: bytes | str | Callable[[Path], object]) -> None:
    """Write ``path`` so that it is always either the old file or the complete new one.

    ``data``: the bytes (or text, as UTF-8), or a function that writes the file at the path
    it is given. It goes to a temporary file in the same folder, is flushed to disk (fsync),
    then renamed over ``path`` (``os.replace``, atomic on POSIX and Windows).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if callable(data):
            data(tmp)
        else:
            tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        with open(tmp, "rb+") as f:  # fsync through any descriptor flushes the file's data
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - folders cannot be opened on Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (prompt files and model files are known by content, not by name)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
