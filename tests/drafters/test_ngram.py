"""The n-gram predictor as a pure unit, and the drafter around it."""

from __future__ import annotations

import doctest

import specdraft.drafters.ngram as ngram_module
from specdraft.drafters.ngram import FNV_OFFSET_BASIS, FNV_PRIME, NGramPredictor, fnv1a_64


def _fnv1a_bytes(data: bytes) -> int:
    """Textbook FNV-1a 64 over bytes, to check the token version against."""
    h = FNV_OFFSET_BASIS
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) % 2**64
    return h


def test_docstring_examples():
    result = doctest.testmod(ngram_module)
    assert result.attempted >= 6 and result.failed == 0


def test_fnv1a_matches_the_reference():
    assert _fnv1a_bytes(b"a") == 0xAF63DC4C8601EC8C  # published FNV-1a 64 test vector
    tokens = [97, 49151, 2**31 + 5]
    assert fnv1a_64(tokens) == _fnv1a_bytes(b"".join(t.to_bytes(4, "little") for t in tokens))


def test_longest_context_wins_over_shorter_ones():
    p = NGramPredictor()
    p.extend([1, 2, 3, 9, 4, 3, 8, 1, 2, 3])
    # 1-token context "3" was last followed by 8, but the 3-token context "1 2 3" saw 9
    assert p.predict(1) == [9]


def test_most_frequent_continuation_wins():
    p = NGramPredictor(min_order=2, max_order=2)
    p.extend([5, 1, 5, 1, 5, 2, 5])
    assert p.predict_next([5]) == 1  # 5->1 twice, 5->2 once


def test_history_is_a_sliding_window_but_tables_are_kept():
    p = NGramPredictor(history=16)
    p.extend([7, 8, 9] + list(range(100, 140)))
    assert len(p.history) == 16
    assert p.predict_next([7, 8]) == 9  # learnt long before it left the window


def test_chaining_stops_when_nothing_matches():
    p = NGramPredictor()
    p.extend([1, 2, 3])
    assert p.predict(4) == []  # "3" was never followed by anything


def test_drafter_learns_accepted_tokens_and_resets(tiny_model):
    from specdraft import SpeculativeDecoder
    from specdraft.types import DraftContext

    dec = SpeculativeDecoder(tiny_model, None, drafter="ngram", spec_length=3)
    drafter = dec.drafter
    drafter.reset()
    ctx = DraftContext(token_ids=[[1, 2, 3, 4]], prompt_lengths=[4], active=[True], vocab_size=64,
                       device="cpu", sampling=None)
    assert drafter.propose(ctx, 3).token_ids.shape == (1, 0)
    ctx.token_ids[0].extend([1, 2])  # accepted output repeats the prompt's start
    assert drafter.propose(ctx, 3).token_ids.tolist() == [[3, 4, 1]]
    drafter.reset()
    ctx2 = DraftContext(token_ids=[[9, 9]], prompt_lengths=[2], active=[True], vocab_size=64, device="cpu", sampling=None)
    assert drafter.propose(ctx2, 2).token_ids.tolist() == [[9, 9]]
