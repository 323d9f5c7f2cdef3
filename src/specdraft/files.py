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


def weights_problem(exc: BaseException) -> str | None:
    """What is wrong with a weights file, from what loading it raised, as the end of a sentence
    about the file ("... is not a complete safetensors file (...)"); None when ``exc`` says nothing
    about the file itself.

    A pickle that ``torch.load(weights_only=True)`` refuses is named with the Python global it
    holds, in one line, without torch's several lines of advice (which includes turning the
    safety check off)."""
    import pickle
    import re

    first = (str(exc).strip().splitlines() or [""])[0].strip()
    if type(exc).__name__ == "SafetensorError":
        return (f"is not a complete safetensors file ({first}): it is truncated or corrupt; download or copy it "
                "again")
    if isinstance(exc, pickle.UnpicklingError) and "weights only load failed" in str(exc).lower():
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        holds = f" ({found.group(1)})" if found else ""
        return (f"is a pickle holding Python objects besides tensors{holds}, which torch does not load safely; use "
                "a safetensors copy of it (convert it only if you trust its source)")
    if isinstance(exc, (pickle.UnpicklingError, EOFError)) or (
            isinstance(exc, RuntimeError) and "PytorchStreamReader" in str(exc)) or _raised_by_torch_load(exc):
        reason = first.split(". ")[0]
        reason = f"{type(exc).__name__}: {reason}" if reason and not isinstance(exc, RuntimeError) else (
            reason or type(exc).__name__)
        return f"is not a readable PyTorch file ({reason}): it is truncated or corrupt; download or copy it again"
    return None


def _raised_by_torch_load(exc: BaseException) -> bool:
    """Whether ``exc`` came from inside ``torch.load`` (its unpickler fails on garbage with
    any error: KeyError, IndexError, ...)."""
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if name.endswith(("torch/serialization.py", "torch/_weights_only_unpickler.py")):
            return True
        tb = tb.tb_next
    return False
