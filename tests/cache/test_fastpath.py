"""The few-row CPU fast path computes what F.linear computes, and leaves the model untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdraft.fastpath import MAX_ROWS, few_row_linear, few_row_linears


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


def test_swap_is_temporary(tiny_model):
    linears = [m for m in tiny_model.modules() if isinstance(m, torch.nn.Linear)]
    with few_row_linears(tiny_model):
        assert all(type(m) is not torch.nn.Linear for m in linears)
        ids = torch.tensor([[1, 2, 3]])
        fast = tiny_model(ids).logits
    assert all(type(m) is torch.nn.Linear for m in linears)
    assert torch.allclose(fast, tiny_model(ids).logits, atol=1e-12)
