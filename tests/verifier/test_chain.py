"""The acceptance rules as pure functions: greedy edge cases and exact sampling."""

from __future__ import annotations

import pytest
import torch

from specdraft.sampling import SamplingParams, logits_to_probs
from specdraft.testing import SIGNIFICANCE as ALPHA
from specdraft.testing import chi_square_pvalue
from specdraft.verifier.chain import greedy_accept, rejection_sample

V = 8  # vocabulary of the synthetic distributions
N = 40_000  # independent rows per statistical test


def test_greedy_accepts_all_and_takes_bonus():
    draft = torch.tensor([[3, 4, 5]])
    target = torch.tensor([[3, 4, 5, 6]])
    n, nxt = greedy_accept(draft, torch.tensor([3]), target)
    assert n.tolist() == [3] and nxt.tolist() == [6]


def test_greedy_stops_at_first_mismatch_even_if_later_tokens_match():
    draft = torch.tensor([[3, 9, 5]])
    target = torch.tensor([[3, 4, 5, 6]])
    n, nxt = greedy_accept(draft, torch.tensor([3]), target)
    assert n.tolist() == [1] and nxt.tolist() == [4]


def test_greedy_early_mismatch_and_empty_and_short_rows():
    draft = torch.tensor([[7, 4, 5], [3, 4, 5], [3, 4, 5]])
    target = torch.tensor([[3, 4, 5, 6]] * 3)
    # row 0 mismatches at once; row 1 drafted nothing; row 2 has 2 real tokens (the 3rd is padding)
    n, nxt = greedy_accept(draft, torch.tensor([3, 0, 2]), target)
    assert n.tolist() == [0, 0, 2]
    assert nxt.tolist() == [3, 3, 5]


def test_greedy_with_no_draft_columns_is_a_plain_step():
    n, nxt = greedy_accept(torch.zeros((2, 0), dtype=torch.long), torch.tensor([0, 0]), torch.tensor([[5], [2]]))
    assert n.tolist() == [0, 0] and nxt.tolist() == [5, 2]


def _random_dists(k: int, seed: int, sharp: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, V, generator=g, dtype=torch.float64) * sharp
    draft_logits = torch.randn(k, V, generator=g, dtype=torch.float64) * sharp
    return target_logits, draft_logits


def _run(target_probs, draft_probs, k, seed, one_hot_tokens=None):
    """N independent rows of one round; returns (num_accepted, next_token, draft_tokens)."""
    g = torch.Generator().manual_seed(seed)
    if one_hot_tokens is None:
        draft_tokens = torch.multinomial(draft_probs, N, replacement=True, generator=g).T  # [N, k]
        dp = draft_probs.expand(N, k, V)
    else:
        draft_tokens = one_hot_tokens.expand(N, k)
        dp = None
    tp = target_probs.expand(N, k + 1, V)
    n, nxt = rejection_sample(draft_tokens, torch.full((N,), k), dp, tp, g)
    return n, nxt, draft_tokens


def _first_token(n, nxt, draft_tokens):
    return torch.where(n > 0, draft_tokens[:, 0], nxt)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
])
def test_first_emitted_token_follows_target(params):
    target_logits, draft_logits = _random_dists(k=3, seed=1)
    target_probs = logits_to_probs(target_logits, params)
    draft_probs = logits_to_probs(draft_logits, params)  # same processing on both sides
    n, nxt, d = _run(target_probs, draft_probs, 3, seed=2)
    counts = torch.bincount(_first_token(n, nxt, d), minlength=V)
    assert chi_square_pvalue(counts, target_probs[0]) > ALPHA


def test_second_token_follows_target_given_first_accepted():
    target_logits, draft_logits = _random_dists(k=3, seed=3)
    params = SamplingParams(temperature=1.0)
    target_probs, draft_probs = logits_to_probs(target_logits, params), logits_to_probs(draft_logits, params)
    n, nxt, d = _run(target_probs, draft_probs, 3, seed=4)
    kept = n >= 1
    second = torch.where(n[kept] >= 2, d[kept, 1], nxt[kept])
    assert chi_square_pvalue(torch.bincount(second, minlength=V), target_probs[1]) > ALPHA


def test_bonus_token_follows_target_after_full_acceptance():
    target_logits, _ = _random_dists(k=2, seed=5)
    target_probs = logits_to_probs(target_logits, SamplingParams(temperature=1.0))
    # a draft identical to the target is always accepted, so every row takes a bonus token
    n, nxt, _ = _run(target_probs, target_probs[:2], 2, seed=6)
    assert bool((n == 2).all())
    assert chi_square_pvalue(torch.bincount(nxt, minlength=V), target_probs[2]) > ALPHA


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=3)])
def test_one_hot_draft_follows_target(params):
    target_logits, _ = _random_dists(k=2, seed=7)
    target_probs = logits_to_probs(target_logits, params)
    tokens = torch.tensor([[int(target_logits[0].argmax()), 0]])  # a likely then an arbitrary token
    n, nxt, d = _run(target_probs, None, 2, seed=8, one_hot_tokens=tokens)
    assert chi_square_pvalue(torch.bincount(_first_token(n, nxt, d), minlength=V), target_probs[0]) > ALPHA
    # P(accept d_1) = target_probs[0][d_1] for a one-hot draft
    rate = (n > 0).double().mean()
    assert abs(float(rate) - float(target_probs[0, tokens[0, 0]])) < 4 * (0.25 / N) ** 0.5


def test_the_test_has_power_against_a_wrong_sampler():
    """Accepting every draft (no rejection) gives the draft's distribution: the check must catch it."""
    target_logits, draft_logits = _random_dists(k=1, seed=9)
    params = SamplingParams(temperature=1.0)
    target_probs, draft_probs = logits_to_probs(target_logits, params), logits_to_probs(draft_logits, params)
    g = torch.Generator().manual_seed(10)
    wrong = torch.multinomial(draft_probs[0], N, replacement=True, generator=g)
    assert chi_square_pvalue(torch.bincount(wrong, minlength=V), target_probs[0]) < ALPHA


def test_seeded_rejection_sampling_is_reproducible():
    target_logits, draft_logits = _random_dists(k=3, seed=11)
    params = SamplingParams(temperature=1.0)
    tp, dp = logits_to_probs(target_logits, params), logits_to_probs(draft_logits, params)
    a, b = _run(tp, dp, 3, seed=12), _run(tp, dp, 3, seed=12)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_logits_to_probs_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    greedy = logits_to_probs(logits, SamplingParams())
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    top2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[0, 2:] == 0).all() and torch.allclose(top2.sum(), torch.tensor(1.0, dtype=torch.float64))
    full = logits.softmax(-1)[0]
    # top_p just above the mass of the first token keeps exactly two tokens
    top_p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-6))
    assert (top_p[0] > 0).sum() == 2
    # top_p below the first token's mass keeps only the argmax
    assert (logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))[0] > 0).sum() == 1
    hot = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(hot, (logits / 0.5).softmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_greedy_argmax_is_torchs_first_largest_with_ties_and_nans(dtype):
    """``sampling.argmax`` (half-width logits widened on a CPU) picks what ``Tensor.argmax`` picks:
    the first of tied largest entries (common in bfloat16), a NaN if any, over rows of a real vocabulary."""
    from specdraft.sampling import argmax

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 49152, generator=g) * 2).round().to(dtype)  # rounded: ties at the top
    logits[0, 1, 17] = logits[0, 1, 40000] = logits[0, 1].max() + 1  # a tie: the first wins
    logits[1, 2, 30000] = float("nan")
    logits[2, 0, :] = float("-inf")
    chosen = argmax(logits)
    assert torch.equal(chosen, logits.argmax(-1))
    assert chosen[0, 1] == 17 and chosen[1, 2] == 30000 and chosen[2, 0] == 0
    ties = (logits == logits.max(-1, keepdim=True).values).sum(-1)
    assert int((ties > 1).sum()) >= 8  # the ties were really there
