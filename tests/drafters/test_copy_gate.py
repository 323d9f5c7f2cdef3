"""The copy gate's greedy choice against its mixture, built out in full."""

from __future__ import annotations

import pytest
import torch

from specdraft.drafters.common.copy_gate import CopyDrafting, CopyGate, copy_mixture


@pytest.mark.parametrize("trimmed", [False, True])
def test_choose_is_the_argmax_of_the_mixture_and_its_probability(trimmed):
    """``choose`` (greedy drafting's few-operation path) picks the copy mixture's most likely
    token and reports that token's probability under the mixture, for rows whose candidate
    is in the head, outside a trimmed head, or missing."""
    torch.manual_seed(3)
    vocab, hidden, rows = 40, 8, 64
    head_ids = torch.randperm(vocab)[:25].sort().values if trimmed else None
    gate = CopyGate(hidden).double()
    for p in gate.parameters():
        torch.nn.init.normal_(p, std=1.0)
    drafting = CopyDrafting(gate, head_ids, vocab)
    small = torch.randn(rows, vocab if head_ids is None else len(head_ids), dtype=torch.float64) * 3
    features = torch.randn(rows, hidden, dtype=torch.float64)
    copy_ids = torch.randint(-1, vocab, (rows,))
    match = torch.where(copy_ids >= 0, torch.randint(1, 4, (rows,)), 0)

    token, confidence = drafting.choose(small, features, copy_ids, match)

    logp, g, _ = drafting.gated(small, features, copy_ids, match)
    probs = torch.zeros(rows, vocab, dtype=torch.float64)
    columns = torch.arange(vocab) if head_ids is None else head_ids
    probs[:, columns] = logp.exp().double()
    mixture = copy_mixture(probs, g, copy_ids)
    assert torch.equal(token, mixture.argmax(-1))
    torch.testing.assert_close(confidence.double(), mixture.max(-1).values, rtol=1e-6, atol=1e-6)
    assert (g > 0).any() and (g == 0).any() and (token == copy_ids).any() and (token != copy_ids).any()


def test_device_candidates_are_lookups():
    """The copy candidate computed on the device for every row at once (no copy to the host) is
    prompt lookup's (``lookup(row, 1)``): the token after the most recent earlier occurrence of the
    longest trailing n-gram, n in 3..1; rows of different lengths, padded, with and without matches."""
    from specdraft.drafters.common.copy_gate import device_candidates
    from specdraft.drafters.common.lookup import lookup

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        lengths = torch.randint(1, 30, (5,), generator=gen)
        vocab = int(torch.randint(2, 9, (1,), generator=gen))  # small vocabularies: many matches
        ids = torch.randint(vocab, (5, int(lengths.max()) + 3), generator=gen)  # padding past each length
        candidate, n = device_candidates(ids, lengths, 1, 3)
        for b in range(5):
            row = ids[b, : lengths[b]].tolist()
            follow, matched = lookup(row, 1, 1, 3)
            assert (int(candidate[b]), int(n[b])) == (follow[0] if follow else -1, matched), (trial, row)


@pytest.mark.parametrize("trimmed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_operator_chooses_as_python_does(trimmed, dtype):
    """``specdraft_cpu::copy_choose`` (greedy drafting's candidates and choice in one C++ call on
    CPU) gives the tokens of :func:`device_candidates` then :meth:`CopyDrafting.choose`, and their
    mixture probabilities within float32 rounding, for padded rows of different lengths, with
    and without a candidate, in and outside a trimmed head."""
    from specdraft.drafters.common.copy_gate import DraftedRows, device_candidates
    from specdraft.services import DrafterServices

    if DrafterServices().cpu_operator("copy_choose") is None:
        pytest.skip("no C++ extension here")
    gen = torch.Generator().manual_seed(5)
    vocab, hidden, rows = 48, 16, 64
    head_ids = torch.randperm(vocab, generator=gen)[:30].sort().values if trimmed else None
    gate = CopyGate(hidden)
    for p in gate.parameters():
        torch.nn.init.normal_(p, std=1.0)
    drafting = CopyDrafting(gate, head_ids, vocab, DrafterServices())
    small = (torch.randn(rows, vocab if head_ids is None else len(head_ids), generator=gen) * 3).to(dtype)
    features = torch.randn(rows, hidden, generator=gen).to(dtype)
    lengths = torch.randint(1, 40, (rows,), generator=gen)
    ids = torch.randint(6, (rows, int(lengths.max()) + 2), generator=gen)  # few tokens: many matches
    ids[: rows // 2] = torch.randint(vocab, (rows // 2, ids.shape[1]), generator=gen)  # and rows with few

    assert drafting._native(small)
    token, confidence = drafting._native_choose(small, features, DraftedRows(ids, lengths))
    copy_ids, match = device_candidates(ids, lengths, gate.min_ngram, gate.max_ngram)
    want, want_confidence = drafting.choose(small.float(), features.float(), copy_ids, match)
    assert torch.equal(token, want)
    torch.testing.assert_close(confidence, want_confidence, rtol=1e-5, atol=1e-6)
    assert (match > 0).any() and (match == 0).any() and (token == copy_ids).any() and (token != copy_ids).any()
