"""Greedy chains drafted whole (``whole_chain``: ``chain_whole`` through ``runner.loop``, one CUDA
graph per round on a GPU) by EAGLE, EAGLE-3 and a draft model (both through a copy gate too): run
here on a CPU, they draft what
the token-by-token loop drafts, keep decoding exact, and hold nothing a CUDA graph could not (no
device read, no tensor made from host data)."""

from __future__ import annotations

import pytest
import torch

from specdraft import SpeculativeDecoder
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.heads.drafters import EagleDrafter
from specdraft.runner.runner import ModelRunner
from specdraft.testing import gated_draft, random_heads, repetitive_prompts, tiny_llama
from specdraft.testing.syncs import HostSyncs

KINDS = {"eagle": EagleDrafter, "eagle3": EagleDrafter, "draft-model": DraftModelDrafter}
#: a drafter with a copy gate (the shipped EAGLE heads and draft have one) -> the drafter; "-on-device":
#: its choice by tensor operators as on a GPU, not by the CPU's C++ operator
GATED = {f"{kind}-copy-gate{where}": kind for kind in ("eagle", "draft-model") for where in ("", "-on-device")}


def _drafter(kind):
    return GATED.get(kind, kind)


def _device_gate(kind, monkeypatch):
    """For the ``-on-device`` kinds: the copy gate chooses as it does on a GPU (``device_candidates``
    and ``choose``), not through the CPU's C++ operator."""
    if kind.endswith("-on-device"):
        from specdraft.drafters.common.copy_gate import CopyDrafting

        monkeypatch.setattr(CopyDrafting, "_native", lambda self, small: False)
_PROPOSE = {cls: cls.propose for cls in KINDS.values()}


def _options(kind, model, path, **more):
    """The drafter's options on ``model``: random heads, or a saved 1-layer random draft (with a
    copy gate that often trusts its candidate for :data:`GATED`)."""
    if GATED.get(kind) == "draft-model":
        return {"model": gated_draft(model, path, seed=5), **more}
    if kind in GATED:
        return _options("eagle", model, path, copy_gate=True, **more)
    if kind == "draft-model":
        tiny_llama(vocab_size=64, seed=7, layers=1, dtype=model.dtype).save_pretrained(path)
        return {"model": str(path), **more}
    return {"heads": str(random_heads(kind, model, path, scale=1.0, copy_gate=more.pop("copy_gate", False))), **more}


def _run(model, options, kind, whole, monkeypatch, prompts, **settings):
    """Greedy outputs, and every proposal as ``(k, tokens cut at each row's length, lengths, a draft
    model's count of drafted tokens fed)``."""
    kind = _drafter(kind)
    cls, drafts = KINDS[kind], []

    def recorded(self, ctx, k):
        draft = _PROPOSE[cls](self, ctx, k)
        lengths = draft.lengths.tolist() if draft.lengths is not None else [draft.token_ids.shape[1]] * ctx.batch_size
        fed = getattr(self, "_drafts_fed", {})  # a draft model's count of drafted tokens in its cache, per row
        fed = [fed.get(i, 0) for i in ctx.seq_ids]
        drafts.append((k, [row[:n].tolist() for row, n in zip(draft.token_ids, lengths)], lengths, fed))
        return draft

    monkeypatch.setattr(cls, "propose", recorded)
    monkeypatch.setattr(cls, "whole_chain", whole)
    with SpeculativeDecoder(model, None, drafter=kind, spec_length=4, adaptive=False, drafter_options=options) as dec:
        out = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=16, **settings)]
    return out, drafts


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", [*KINDS, *GATED])
def test_a_whole_chain_drafts_what_the_loop_drafts(tmp_path, monkeypatch, kind, dtype):
    """Same greedy outputs as plain decoding, and the same drafts, token for token and length for
    length, as the loop that stops at the first row's doubt; the threshold (0.3) stops some rows
    early, so the lengths the whole chain keeps on the device are tested."""
    _device_gate(kind, monkeypatch)
    model = tiny_llama(vocab_size=64, seed=0, dtype=dtype)
    prompts = repetitive_prompts(64, seed=3)[:3]
    with SpeculativeDecoder(model, None, drafter=None) as dec:
        plain = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=16)]
    for threshold in (0.0, 0.3):
        options = _options(kind, model, tmp_path / f"{kind}-{threshold}", min_confidence=threshold)
        loop_out, loop_drafts = _run(model, options, kind, False, monkeypatch, prompts)
        whole_out, whole_drafts = _run(model, options, kind, True, monkeypatch, prompts)
        assert whole_out == loop_out == plain
        if threshold == 0:
            assert whole_drafts == loop_drafts
        else:  # here the loop stops once every row has (a CPU reads that); the whole chain feeds on to k
            assert [d[:3] for d in whole_drafts] == [d[:3] for d in loop_drafts]
        stopped = [n for k, _, ns, _ in whole_drafts[1:] for n in ns if n < k]  # round one: a row without state
        assert bool(stopped) == (threshold > 0), stopped


@pytest.mark.parametrize("kind", ["eagle", "eagle-copy-gate-on-device", "draft-model",
                                  "draft-model-copy-gate-on-device"])
def test_a_whole_chain_holds_nothing_a_graph_cannot(tiny_model, tmp_path, monkeypatch, kind):
    """The function ``runner.loop`` would capture reads nothing from the device and makes no
    tensor from host data, over batched rounds of three rows of different lengths."""
    found, loop = [], ModelRunner.loop

    def checked(self, fn, inputs, steps, slots=None, key=()):
        def watched(*args):
            with HostSyncs(host_data=True) as syncs:
                out = fn(*args)
            found.append(dict(syncs.where))
            return out

        return loop(self, watched, inputs, steps, slots, key)

    _device_gate(kind, monkeypatch)
    monkeypatch.setattr(ModelRunner, "loop", checked)
    monkeypatch.setattr(KINDS[_drafter(kind)], "whole_chain", True)
    options = _options(kind, tiny_model, tmp_path / kind, min_confidence=0.3)
    with SpeculativeDecoder(tiny_model, None, drafter=_drafter(kind), spec_length=4,
                            adaptive=False, drafter_options=options) as dec:
        dec.generate_ids(repetitive_prompts(64, seed=0)[:3], max_new_tokens=12)
    assert len(found) >= 3
    assert all(not where for where in found), [where for where in found if where]


@pytest.mark.parametrize("kind", ["eagle", "draft-model"])
def test_a_whole_chain_is_not_used_where_a_graph_cannot_hold_the_draws(tiny_model, tmp_path, monkeypatch, kind):
    """Sampling and penalties draft token by token (their draws read per-row generators or the
    context's counts): the whole chain is never entered."""

    def refuse(*args, **kwargs):
        raise AssertionError("a whole chain was drafted")

    monkeypatch.setattr(ModelRunner, "loop", refuse)
    monkeypatch.setattr(KINDS[kind], "whole_chain", True)
    cases = [({}, {"temperature": 0.8, "seed": 1}), ({}, {"repetition_penalty": 1.3})]
    for i, (options, settings) in enumerate(cases):
        options = _options(kind, tiny_model, tmp_path / f"{kind}-{i}", **options)
        with SpeculativeDecoder(tiny_model, None, drafter=kind, spec_length=3, adaptive=False,
                                drafter_options=options) as dec:
            assert all(r.token_ids for r in dec.generate_ids(repetitive_prompts(64, seed=0)[:2], max_new_tokens=8,
                                                             **settings))
