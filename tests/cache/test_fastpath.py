"""The few-row CPU fast path computes what F.linear computes, and leaves the model untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdraft import fastpath
from specdraft.fastpath import CANDIDATES, MAX_ROWS, few_row_linear, few_row_linears


@pytest.mark.parametrize("shape", [(1, 1, 16), (1, 5, 16), (3, 2, 16), (MAX_ROWS + 1, 16), (0, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_f_linear(shape, bias):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    w = torch.randn(24, 16, dtype=torch.float64)
    b = torch.randn(24, dtype=torch.float64) if bias else None
    out = few_row_linear(x, w, b)
    assert out.shape == (*shape[:-1], 24) and out.is_contiguous()
    assert torch.allclose(out, F.linear(x, w, b), atol=1e-12)


@pytest.mark.parametrize("name", list(CANDIDATES))
@pytest.mark.parametrize("rows", [1, 2, 4, 7])
def test_every_candidate_is_f_linear(name, rows):
    """Whatever the measurement picks on a given machine computes the same product."""
    torch.manual_seed(1)
    x, w, b = torch.randn(rows, 16, dtype=torch.float64), torch.randn(24, 16, dtype=torch.float64), None
    for bias in (None, torch.randn(24, dtype=torch.float64)):
        assert torch.allclose(CANDIDATES[name](x, w, bias), F.linear(x, w, bias), atol=1e-12)


def test_choice_is_measured_once_per_shape(monkeypatch):
    monkeypatch.setattr(fastpath, "_chosen", {})
    calls, real_tune = [], fastpath._tune
    monkeypatch.setattr(fastpath, "_tune", lambda key, *a: calls.append(key) or real_tune(key, *a))
    w = torch.randn(24, 16, dtype=torch.float64)
    for _ in range(3):
        few_row_linear(torch.randn(2, 16, dtype=torch.float64), w, None)
    assert calls == [(24, 16, 2, torch.float64)]
    assert fastpath.chosen() == {(24, 16, 2, torch.float64): fastpath.chosen()[(24, 16, 2, torch.float64)]}
    assert fastpath.chosen()[(24, 16, 2, torch.float64)] in CANDIDATES


def test_training_keeps_autograd():
    """Inputs that need gradients take F.linear itself."""
    w = torch.randn(24, 16, requires_grad=True)
    few_row_linear(torch.randn(2, 16), w, None).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_swap_is_temporary(tiny_model):
    linears = [m for m in tiny_model.modules() if isinstance(m, torch.nn.Linear)]
    with few_row_linears(tiny_model):
        assert all(type(m) is not torch.nn.Linear for m in linears)
        ids = torch.tensor([[1, 2, 3]])
        fast = tiny_model(ids).logits
    assert all(type(m) is torch.nn.Linear for m in linears)
    assert torch.allclose(fast, tiny_model(ids).logits, atol=1e-12)


def test_prepare_measures_every_shape_ahead(tiny_model, monkeypatch):
    monkeypatch.setattr(fastpath, "_chosen", {})
    fastpath.prepare(tiny_model, [1, 3])
    shapes = {tuple(m.weight.shape) for m in tiny_model.modules() if isinstance(m, torch.nn.Linear)}
    assert set(fastpath.chosen()) == {(*s, n, torch.float64) for s in shapes for n in (1, 3)}
