"""A CPU fast path for the few-row matrix products of decoding, chosen by measurement.

On CPU, the best way to compute ``F.linear(x, W)`` for a handful of rows depends on the
processor and the BLAS build, and the difference is large:

* On an AMD EPYC (MKL, 2 cores), ``x @ W.T`` packs ``W`` on every call: SmolLM2-135M's
  49152 x 576 output head took 11.8 ms for 5 rows that way and 3.5 ms as ``(W @ x.T).T``,
  and a whole 1-token step went from 36.8 to 27.2 ms with the transposed product.
* On an Intel Xeon with AVX-512 (same torch build), the opposite: ``(W @ x.T).T`` doubled
  a 1-token step (34 -> 74 ms), while ``x @ W.T`` is fast for up to 3 rows and jumps at 4,
  where splitting the rows into smaller products is cheaper.

So nothing is hard-coded: the first time a weight shape meets a row count,
:func:`few_row_linear` times each candidate on that very input (a few interleaved
repetitions, best of each) and keeps the fastest for the rest of the process. All
candidates compute the same product; they differ only in float rounding, which is why
greedy parity tests run in float64.

:func:`few_row_linears` swaps every plain ``nn.Linear`` of a model to this path for the
duration of a ``with`` block, so specdraft's own forward passes get it and the model
object is left exactly as it was.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F

#: Inputs with at most this many rows (batch x positions) take a measured path.
MAX_ROWS = 32
#: Timed repetitions of each candidate when a (shape, rows) pair is first seen.
TUNE_REPEATS = 5


def _linear(x, weight, bias):  # [rows, in] -> [rows, out]
    return F.linear(x, weight, bias)


def _transposed(x, weight, bias):
    rows = x.shape[0]
    if rows == 1:
        x = torch.cat([x, x])  # a real copy: the matrix-vector path (or a stride-0 expand) is slower
    out = torch.mm(weight, x.T).T[:rows]
    return out if bias is None else out + bias


def _chunked(size: int) -> Callable:
    def run(x, weight, bias):
        return torch.cat([F.linear(part, weight, bias) for part in x.split(size)])

    return run


#: name -> function(x # [rows, in], weight # [out, in], bias # [out] | None) -> [rows, out]
CANDIDATES: dict[str, Callable] = {"linear": _linear, "transposed": _transposed,
                                   "chunks-of-2": _chunked(2), "chunks-of-3": _chunked(3)}

#: (out, in, rows, dtype) -> the candidate measured fastest on this machine
_chosen: dict[tuple, str] = {}


def _tune(key: tuple, flat: torch.Tensor, weight: torch.Tensor, bias) -> str:
    names = [n for n in CANDIDATES if not n.startswith("chunks") or flat.shape[0] > int(n[-1])]
    best = {n: float("inf") for n in names}
    for _ in range(TUNE_REPEATS):
        for n in names:  # interleaved, so a burst of noise hurts every candidate alike
            start = time.perf_counter()
            CANDIDATES[n](flat, weight, bias)
            best[n] = min(best[n], time.perf_counter() - start)
    _chosen[key] = min(names, key=best.__getitem__)
    return _chosen[key]


def chosen() -> dict[tuple, str]:
    """What was measured so far: ``(out_features, in_features, rows, dtype) -> candidate``."""
    return dict(_chosen)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed the way measured fastest here for few rows on CPU."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (x.device.type != "cpu" or rows == 0 or rows > MAX_ROWS or x.dtype != weight.dtype
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    key = (weight.shape[0], weight.shape[1], rows, x.dtype)
    name = _chosen.get(key) or _tune(key, flat, weight, bias)
    out = CANDIDATES[name](flat, weight, bias)
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def prepare(model: torch.nn.Module, rows) -> None:
    """Measure now, for every linear weight shape of ``model`` and each row count in ``rows``,
    what :func:`few_row_linear` would otherwise measure on first use (so that a timed pass,
    like the verifier's cost estimates, does not include the measuring)."""
    seen = set()
    with torch.inference_mode():
        for m in _plain_linears(model):
            w = m.weight
            if w.device.type != "cpu" or (w.shape, w.dtype) in seen:
                continue
            seen.add((w.shape, w.dtype))
            for n in rows:
                if 0 < n <= MAX_ROWS and (w.shape[0], w.shape[1], n, w.dtype) not in _chosen:
                    few_row_linear(torch.randn(n, w.shape[1], dtype=w.dtype), w, m.bias)


class _FewRowLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_row_linear(x, self.weight, self.bias)


def _plain_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    cached = model.__dict__.get("_specdraft_linears")
    if cached is None:
        cached = [m for m in model.modules() if type(m) is torch.nn.Linear]
        model.__dict__["_specdraft_linears"] = cached
    return cached


@contextmanager
def few_row_linears(model: torch.nn.Module, enabled: bool = True):
    """Within the block, ``model``'s plain ``nn.Linear`` layers use :func:`few_row_linear`."""
    linears = _plain_linears(model) if enabled else []
    # object.__setattr__: nn.Module.__setattr__ would cost ~1.4 ms per forward on SmolLM2
    for m in linears:
        object.__setattr__(m, "__class__", _FewRowLinear)
    try:
        yield
    finally:
        for m in linears:
            object.__setattr__(m, "__class__", torch.nn.Linear)
