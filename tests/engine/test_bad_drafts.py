"""A drafter that breaks the Draft contract or raises gets an error naming it."""

from __future__ import annotations

import pytest
import torch

import specdraft
from specdraft import Draft, DrafterError, SpeculativeDecoder


def _drafter(propose):
    return type("Bad", (specdraft.Drafter,), {"propose": lambda self, ctx, k: propose(ctx, k)})(None, None)


def _run(model, drafter, **kw):
    """Past the plain steps a new length policy times first, so the drafter is asked."""
    return SpeculativeDecoder(model, None, drafter=drafter, spec_length=3).generate_ids([[1, 2, 3]], max_new_tokens=8, **kw)


@pytest.mark.parametrize("propose, message", [
    (lambda ctx, k: [1, 2], "expected a specdraft.Draft, got list"),
    (lambda ctx, k: Draft(token_ids=torch.tensor([[1, 99]])), r"token ids must lie in \[0, 64\); got 1..99"),
    (lambda ctx, k: Draft(token_ids=torch.tensor([[-1]])), r"must lie in \[0, 64\)"),
    (lambda ctx, k: Draft(token_ids=torch.tensor([[1, 2, 3, 4, 5]])), r"expected \[1, <= 3\]"),
    (lambda ctx, k: Draft(token_ids=torch.tensor([[1.0]])), "integer tensor"),
    (lambda ctx, k: Draft(token_ids=torch.tensor([[1]]), probs=torch.ones(1, 1, 64)), "must sum to 1"),
    (lambda ctx, k: Draft(token_ids=torch.tensor([[1]]), probs=torch.full((1, 1, 64), float("nan"))), "finite"),
    (lambda ctx, k: Draft(token_ids=torch.tensor([[1]]), probs=torch.ones(1, 2, 64) / 64), "probs has shape"),
    (lambda ctx, k: Draft(token_ids=torch.tensor([[1]]), probs=torch.nn.functional.one_hot(torch.tensor([[2]]), 64).double()),
     "probability 0 under its own draft"),
    (lambda ctx, k: Draft(token_ids=torch.tensor([[1, 2]]), lengths=torch.tensor([3])), "lengths must be"),
])
def test_malformed_draft_names_the_drafter(tiny_model, propose, message):
    with pytest.raises(DrafterError, match=rf"drafter 'Bad' returned an invalid draft: .*{message}"):
        _run(tiny_model, _drafter(propose), temperature=1.0, seed=0)


def test_exception_inside_a_plugin_drafter_names_drafter_and_plugin(tiny_model, register_plugin):
    import types

    def boom(ctx, k):
        raise KeyError("missing table")

    cls = type("Exploding", (specdraft.Drafter,), {"propose": lambda self, ctx, k: boom(ctx, k)})
    module = types.ModuleType("exploding")
    module.register_drafters = specdraft.hookimpl(lambda register: register("exploding", cls))
    register_plugin(module, "specdraft-exploding")
    with pytest.raises(DrafterError, match=r"drafter 'exploding' \(plugin 'specdraft-exploding'\) raised KeyError in propose\(\)"):
        _run(tiny_model, "exploding")


def test_drafter_failing_to_start_names_its_plugin(register_plugin):
    import types

    from specdraft.testing import tiny_llama

    class NeedsGPU(specdraft.Drafter):
        def __init__(self, options, target):
            raise RuntimeError("CUDA not available")

        def propose(self, ctx, k):  # pragma: no cover
            raise AssertionError

    module = types.ModuleType("gpu")
    module.register_drafters = specdraft.hookimpl(lambda register: register("gpu-only", NeedsGPU))
    register_plugin(module, "specdraft-gpu")
    with pytest.raises(DrafterError, match=r"'gpu-only' \(plugin 'specdraft-gpu'\) failed to start: RuntimeError: CUDA"):
        SpeculativeDecoder(tiny_llama(), None, drafter="gpu-only")
