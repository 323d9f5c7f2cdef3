"""The CUDA-graph plumbing of the runner (``_capture``, ``_replay``, ``loop``, ``forward(then=)``)
run on a CPU with a stand-in for ``torch.cuda.CUDAGraph``: the captured function is run once at
capture and again at each replay, on the graph's static input buffers, its results copied into the
static outputs (what a replayed graph does to its memory). A function that read a live tensor
instead of its static copy, a key that lumps two different passes together, or outputs handed out
without a copy would give other drafts or outcomes here, as they would on a GPU."""

from __future__ import annotations

import pytest
import torch

from specdraft import SpeculativeDecoder
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.heads.drafters import EagleDrafter
from specdraft.runner.runner import ModelRunner
from specdraft.testing import gated_draft, random_heads, repetitive_prompts, tiny_llama


class _Replay:
    def __init__(self, run, outputs) -> None:
        self.run, self.outputs, self.replays = run, outputs, 0

    def replay(self) -> None:
        for buf, value in zip(self.outputs, self.run()):
            if buf is not None:
                buf.copy_(value)
        self.replays += 1


def _stand_in_graphs(monkeypatch) -> list[_Replay]:
    """From here on every model runner takes its CUDA-graph path, with :class:`_Replay` for the
    graphs; returns the list of the graphs made."""
    made = []

    def graph_of(self, run):
        saved = self.cache.lengths.clone()
        outputs = run()  # the capture: the graph's output buffers (the lengths as they were, as after a capture)
        self.cache.lengths.copy_(saved)
        made.append(_Replay(run, outputs))
        return made[-1], outputs

    monkeypatch.setattr(ModelRunner, "cuda_graphs", property(lambda self: True))
    monkeypatch.setattr(ModelRunner, "_graph_of", graph_of)
    return made


def _generate(kind, options, model, prompts):
    drafts, cls = [], DraftModelDrafter if kind == "draft-model" else EagleDrafter
    propose = cls.propose

    def recorded(self, ctx, k):
        draft = propose(self, ctx, k)
        drafts.append([row[:n].tolist() for row, n in zip(draft.token_ids, draft.lengths.tolist())])
        return draft

    cls.propose = recorded
    try:
        with SpeculativeDecoder(model, None, drafter=kind, spec_length=4, adaptive=False, compile=True,
                                drafter_options=options) as dec:
            out = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=16)]
    finally:
        cls.propose = propose
    return out, drafts


@pytest.mark.parametrize("kind", ["eagle", "eagle-copy-gate", "draft-model", "draft-model-copy-gate"])
def test_whole_chains_and_acceptance_replayed_from_graphs_are_what_runs_without(tmp_path, monkeypatch, kind):
    """Greedy rounds through stand-in graphs (the target's passes with acceptance inside, the
    drafter's whole chains): the outputs of plain decoding and the drafts of a run without graphs,
    with every graph replayed at least once."""
    from specdraft.drafters.common.copy_gate import CopyDrafting

    monkeypatch.setattr(CopyDrafting, "_native", lambda self, small: False)  # the gate as on a GPU
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32)
    if kind == "draft-model-copy-gate":
        options = {"model": gated_draft(model, tmp_path / "draft"), "min_confidence": 0.3}
    elif kind == "draft-model":
        tiny_llama(vocab_size=64, seed=7, layers=1, dtype=torch.float32).save_pretrained(tmp_path / "draft")
        options = {"model": str(tmp_path / "draft"), "min_confidence": 0.3}
    else:
        heads = random_heads("eagle", model, tmp_path / "heads", scale=1.0, copy_gate=kind == "eagle-copy-gate")
        options = {"heads": str(heads), "min_confidence": 0.3}
    kind = "eagle" if kind.startswith("eagle") else "draft-model"
    prompts = repetitive_prompts(64, seed=3)[:3]
    with SpeculativeDecoder(model, None, drafter=None) as dec:
        plain = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=16)]
    monkeypatch.setattr(DraftModelDrafter if kind == "draft-model" else EagleDrafter, "whole_chain", True)
    without, drafts = _generate(kind, options, model, prompts)  # compiled, no graphs: a chain runs as it is

    made = _stand_in_graphs(monkeypatch)
    replayed, replayed_drafts = _generate(kind, options, model, prompts)
    assert replayed == without == plain
    assert replayed_drafts == drafts
    assert len(made) >= 3 and all(g.replays for g in made) and sum(g.replays for g in made) > len(made)
