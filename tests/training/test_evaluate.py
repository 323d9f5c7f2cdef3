"""Held-out acceptance: the offline measure of how often a drafter's greedy chain is accepted."""

from __future__ import annotations

import pytest
import torch

from specdraft.training.evaluate import held_out_acceptance, split_held_out

SEQS = [{"ids": [5, 6, 1, 2, 3, 4, 1, 2, 3, 4], "prompt_len": 3, "greedy": True},
        {"ids": [7, 1, 2, 3, 4, 1, 2], "prompt_len": 2, "greedy": True}]


def _shifted(ids: torch.Tensor, depth: int, wrong_from: int | None = None, wrong_at=None) -> list[torch.Tensor]:
    """An oracle: depth s of chain j guesses x_{j+s+1} itself, except where told to be wrong."""
    W = ids.shape[1]
    out = []
    for s in range(1, depth + 1):
        guess = ids[:, s + 1 : W].clone()
        if wrong_from is not None and s >= wrong_from:
            guess += 1000
        if wrong_at is not None:
            guess = torch.where(wrong_at(s, guess), guess + 1000, guess)
        out.append(guess)
    return out


def test_an_oracle_is_always_accepted():
    assert held_out_acceptance(lambda ids, f: _shifted(ids, 3), SEQS, None, depth=3) == [1.0, 1.0, 1.0]


def test_a_chain_stops_at_its_first_wrong_guess():
    assert held_out_acceptance(lambda ids, f: _shifted(ids, 3, wrong_from=2), SEQS, None, depth=3) == [1.0, 0.0, 0.0]


def test_counts_chains_after_the_prompt_only_and_conditions_on_earlier_guesses():
    """Depth 1 wrong at odd chain starts; the chains that survive are right at depth 2, so
    position 2 is as likely as position 1 (acceptance by position is cumulative)."""
    def wrong_at(s, guess):
        j = torch.arange(guess.shape[1])[None].expand_as(guess)
        return (j % 2 == 1) & (s == 1)

    acc = held_out_acceptance(lambda ids, f: _shifted(ids, 2, wrong_at=wrong_at), SEQS[:1], None, depth=2)
    # sequence 0: chains j = 1..7 (j >= prompt_len - 2 = 1, j + 2 < 10); odd j wrong at depth 1
    assert acc[0] == pytest.approx(3 / 7)
    assert acc[1] == pytest.approx(3 / 7)


def test_split_holds_out_greedy_answers_only():
    seqs = [{"ids": [1], "prompt_len": 1, "greedy": i % 2 == 0} for i in range(80)]
    train, held = split_held_out(seqs, every=10)
    assert len(held) == 4 and all(seqs[i]["greedy"] for i in held)
    assert sorted(train + held) == list(range(80)) and not set(train) & set(held)
