"""Greedy acceptance inside the verify pass (``Verifier.verify_greedy``: ``runner.forward(then=)``,
in the pass's CUDA graph on a GPU) gives the Outcome that the pass and ``accept`` give, on a real
runner, eager and compiled (padded width buckets), over ragged rows and subsets of the slots; the
engine takes it for greedy rounds only when nothing else reads the logits."""

from __future__ import annotations

import random

import pytest
import torch

from specdraft import Draft, SpeculativeDecoder
from specdraft.runner import load_runner
from specdraft.sampling import RowSampling, SamplingParams
from specdraft.testing import repetitive_prompts, tiny_llama
from specdraft.testing.syncs import HostSyncs
from specdraft.verifier import Verifier
from specdraft.verifier import core

VOCAB = 4  # random drafts are accepted often enough to test every prefix length


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@torch.inference_mode()
def test_acceptance_in_the_pass_gives_the_outcome_accept_gives(compile):
    runner = load_runner(tiny_llama(vocab_size=VOCAB, seed=3), compile=compile)
    verifier = Verifier(runner, VOCAB, "cpu")
    rng = random.Random(0)
    runner.cache.reset(3, 256)
    lengths = [20, 17, 12]
    runner.forward(torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1)), advance=lengths)
    accepted = []
    for round_ in range(40):
        slots = [0, 1, 2] if round_ % 3 else [2, 0]  # every row, or a subset out of order (a gather)
        k = rng.choice([0, 2, 3, 5])  # 0: a plain step; rows draft 1..k (or none)
        draft = Draft.from_lists([[rng.randrange(VOCAB) for _ in range(rng.choice([0, k]) and rng.randint(1, k))]
                                  for _ in slots])
        proposal = verifier.proposal(draft, [k] * len(slots))
        last, longest = [rng.randrange(VOCAB) for _ in slots], max(lengths)
        logits, hidden = verifier.verify(proposal, last, slots, longest, hidden=True)
        slow = verifier.accept(proposal, logits, RowSampling([SamplingParams()] * len(slots)), [None] * len(slots),
                               None, hidden)
        runner.cache.set_lengths([lengths[s] for s in slots], slots=slots)  # the same pass again
        fast = verifier.verify_greedy(proposal, last, slots, longest, hidden=True)
        for field in ("num_accepted", "next_token", "paths", "tokens", "drafted", "depths"):
            assert getattr(fast, field) == getattr(slow, field), (round_, field)
        assert torch.equal(fast.hidden, slow.hidden)
        assert runner.cache.lengths.tolist() == [lengths[s] + (proposal.width + 1 if s in slots else 0)
                                                 for s in range(3)]
        for b, s in enumerate(slots):
            lengths[s] += fast.num_accepted[b] + 1
        runner.cache.set_lengths([lengths[s] for s in slots], slots=slots)
        accepted += [n for n, d in zip(fast.num_accepted, fast.drafted) if d]
    assert 0 in accepted and max(accepted) >= 2, accepted  # rejections at the first draft and later ones


def test_acceptance_in_the_pass_holds_nothing_a_graph_cannot(tiny_model, monkeypatch):
    """``then``'s function reads nothing from the device and makes no tensor from host data."""
    found, greedy_chain = [], core._greedy_chain

    def watched(*args):
        with HostSyncs(host_data=True) as syncs:
            out = greedy_chain(*args)
        found.append(dict(syncs.where))
        return out

    monkeypatch.setattr(core, "_greedy_chain", watched)
    with SpeculativeDecoder(tiny_model, None, drafter="ngram", spec_length=3, adaptive=False) as dec:
        dec.generate_ids(repetitive_prompts(64, seed=0)[:3], max_new_tokens=12)
    assert len(found) >= 3 and all(not where for where in found), found


@pytest.mark.parametrize("settings, used", [
    ({}, True),
    ({"logprobs": 2}, False),
    ({"repetition_penalty": 1.2}, False),
    ({"logit_bias": {5: 2.0}}, False),
    ({"min_tokens": 10}, False),
    ({"temperature": 0.7, "seed": 3}, False),
], ids=["greedy", "logprobs", "penalty", "logit-bias", "min-tokens", "sampled"])
def test_the_engine_accepts_in_the_pass_only_when_nothing_else_reads_the_logits(tiny_model, monkeypatch,
                                                                                settings, used):
    calls, verify_greedy = [], Verifier.verify_greedy

    def counted(self, *args, **kwargs):
        calls.append(1)
        return verify_greedy(self, *args, **kwargs)

    monkeypatch.setattr(Verifier, "verify_greedy", counted)
    with SpeculativeDecoder(tiny_model, None, drafter="ngram", spec_length=3, adaptive=False) as dec:
        out = dec.generate_ids(repetitive_prompts(64, seed=0)[:2], max_new_tokens=10, **settings)
    assert all(r.token_ids for r in out)
    assert bool(calls) == used, len(calls)
