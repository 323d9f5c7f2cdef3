"""Prompt lookup as a pure unit."""

from __future__ import annotations

import doctest

import pytest

import specdraft.drafters.common.lookup as pl_module
from specdraft.drafters.api import prompt_lookup


def test_docstring_examples():
    result = doctest.testmod(pl_module)
    assert result.attempted >= 4 and result.failed == 0


def test_longer_ngram_preferred_over_more_recent_shorter_one():
    tokens = [1, 2, 3, 40, 41, 9, 3, 50, 1, 2, 3]
    # "1 2 3" (n=3) matched at the start -> 40 41; the more recent "3" alone would give 50
    assert prompt_lookup(tokens, k=2, max_ngram=3) == [40, 41]
    assert prompt_lookup(tokens, k=2, max_ngram=1) == [50, 1]


def test_continuation_is_cut_at_the_end_and_at_k():
    assert prompt_lookup([4, 5, 4], k=5) == [5, 4]
    assert prompt_lookup([4, 5, 6, 7, 8, 4], k=2) == [5, 6]


@pytest.mark.parametrize("tokens", [[], [1], [1, 2, 3]])
def test_nothing_to_find(tokens):
    assert prompt_lookup(tokens, k=3) == []
