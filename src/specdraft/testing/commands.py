"""How tests start the real ``specdraft`` command in a fresh process."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple


def specdraft_command() -> list[str]:
    """The installed ``specdraft`` script beside this interpreter, else ``python -m specdraft.cli``."""
    script = Path(sys.executable).with_name("specdraft")
    return [str(script)] if script.exists() else [sys.executable, "-m", "specdraft.cli"]


class Served(NamedTuple):
    """A ``specdraft serve`` process that printed its ready line."""

    proc: subprocess.Popen
    ready: str  # the ready line ("specdraft: serving ... on http://127.0.0.1:PORT")
    base: str  # the URL it names
    stderr: Path  # where its standard error goes


def start_serve(folder: Path, *args: str, timeout: float = 180) -> Served:
    """``specdraft serve --port 0 ARGS`` in a fresh process, once its ready line is out (its
    standard error goes to ``folder/stderr.txt``). No ready line within ``timeout`` seconds kills
    it and fails with the end of its standard error."""
    err = Path(folder) / "stderr.txt"
    with err.open("w") as log:
        proc = subprocess.Popen([*specdraft_command(), "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                                stderr=log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        ready = lines.get(timeout=timeout).strip()
    except queue.Empty:
        proc.kill()
        proc.wait()
        raise AssertionError(f"no ready line; stderr: {err.read_text()[-2000:]}") from None
    return Served(proc, ready, ready.rsplit(" ", 1)[1], err)


def stop_with_ctrl_c(proc: subprocess.Popen, timeout: float = 30) -> int:
    """Ctrl-C ``proc`` and return its exit status (killed if it has not ended within ``timeout``)."""
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


__all__ = ["Served", "specdraft_command", "start_serve", "stop_with_ctrl_c"]
