"""Counting what would be device-to-host copies (host syncs on a GPU), on any device.

    with HostSyncs() as syncs:
        engine.step()
    syncs.count, syncs.where   # how many, and from which lines of specdraft

On a GPU each of these waits for the device to finish: a tensor's ``.item()``, ``int()``,
``float()``, ``bool()`` (``aten::_local_scalar_dense``), ``.tolist()``, ``.numpy()``, ``.cpu()``
and ``.to("cpu")``. On a CPU they cost nothing, which is why a CPU test can count them all: every
one counted here would be a sync if the tensor lived on a GPU (on a CPU nothing tells host
bookkeeping apart from device values, so specdraft keeps host bookkeeping in Python lists).

Each is counted at the tensor method as well as in the dispatcher: under ``torch.inference_mode``
(the engine's passes) the dispatcher hands ``_local_scalar_dense`` to no Python mode, so
``int()`` and ``bool()`` went uncounted. Reads that happen on a CPU only (:data:`CPU_ONLY`) are not
counted.
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PACKAGE = str(Path(__file__).resolve().parents[1])


#: functions that read the device only where that is free (a CPU) or under SPECDRAFT_DEBUG, never
#: on a GPU: what they copy is not counted
CPU_ONLY = frozenset({"_check_values", "_width_on_cpu", "_any_alive_on_cpu"})


def _caller() -> str | None:
    """The innermost specdraft line outside this module that asked for the copy (None: a read
    that happens on a CPU only, :data:`CPU_ONLY`)."""
    stack = traceback.extract_stack()[:-2]
    if any(frame.name in CPU_ONLY and frame.filename.startswith(_PACKAGE) for frame in stack):
        return None
    for frame in reversed(stack):
        if frame.filename.startswith(_PACKAGE) and not frame.filename.endswith("syncs.py"):
            return f"{Path(frame.filename).relative_to(_PACKAGE)}:{frame.lineno} {frame.line}"
    return "outside specdraft"


class HostSyncs(TorchDispatchMode):
    """Counts the copies of the module's docstring inside its ``with`` block: ``count``, and
    ``where`` (a Counter of the specdraft lines that asked).

    ``host_data=True`` also counts tensors made from host data (``torch.tensor(list)``,
    ``aten::lift_fresh``): a copy the other way, which a CUDA graph cannot hold either (what
    it captures must read nothing from the host and write nothing to it)."""

    METHODS = ("tolist", "numpy", "cpu", "item", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, host_data: bool = False) -> None:
        super().__init__()
        self.where: collections.Counter = collections.Counter()
        self._saved: dict[str, object] = {}
        self._made = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default) if host_data else ()

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def _record(self) -> None:
        caller = _caller()
        if caller is not None:
            self.where[caller] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default or func in self._made:
            self._record()
        elif func in (torch.ops.aten._to_copy.default,) and (kwargs or {}).get("device") == torch.device("cpu"):
            self._record()
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(tensor, *args, _original=original, **kwargs):
                self._record()
                with torch.utils._python_dispatch._disable_current_modes():
                    return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)


__all__ = ["HostSyncs"]
