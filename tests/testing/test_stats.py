"""The statistics behind every sampled test: the power calculation holds, the reference is independent."""

from __future__ import annotations

import pytest
import torch

from specdraft.sampling import SamplingParams, TokenCounts, logits_to_probs
from specdraft.testing import SIGNIFICANCE, chi_square_pvalue, reference_probs, samples_needed
from specdraft.testing.stats import EFFECT, POWER


def _deviated(probs: torch.Tensor, effect: float) -> torch.Tensor:
    """``probs`` with mass moved from its least to its most likely token, by Cohen's ``effect``."""
    lo, hi = int(probs.argmin()), int(probs.argmax())
    # w^2 = d^2 / p_lo + d^2 / p_hi  ->  d
    d = effect / (1 / probs[lo] + 1 / probs[hi]) ** 0.5
    out = probs.clone()
    out[lo] -= d
    out[hi] += d
    return out


def test_samples_needed_gives_the_stated_power():
    """Simulated: at the computed sample size a deviation of EFFECT is rejected about POWER of the
    time at the Bonferroni level, and the exact distribution about SIGNIFICANCE of the time."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(16, generator=gen, dtype=torch.float64) * 0.5, -1)
    tests = 8
    n = samples_needed(15, tests)
    trials = 300
    level = SIGNIFICANCE / tests
    off = _deviated(probs, EFFECT)
    rejected = sum(chi_square_pvalue(torch.bincount(torch.multinomial(off, n, True, generator=gen), minlength=16),
                                     probs) < level for _ in range(trials))
    false = sum(chi_square_pvalue(torch.bincount(torch.multinomial(probs, n, True, generator=gen), minlength=16),
                                  probs) < level for _ in range(trials))
    assert rejected / trials > POWER - 0.06  # 0.84: three binomial standard deviations below 0.9
    assert false <= 2
    assert samples_needed(15, tests, effect=2 * EFFECT) < n / 3  # four times the effect, a quarter the samples


@pytest.mark.parametrize("seed", range(6))
def test_the_reference_and_the_pipeline_agree(seed):
    """Two implementations of one law: transformers' processors (the tests' reference) and
    specdraft's pipeline, on random logits, contexts and settings in float64."""
    gen = torch.Generator().manual_seed(seed)
    vocab, rows = 24, 5
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2
    context = torch.randint(vocab, (rows, 9), generator=gen)
    generated = context[:, 4:]
    u = torch.rand(7, generator=gen).tolist()
    params = SamplingParams(temperature=0.3 + u[0], top_k=int(u[1] * 12), top_p=0.5 + 0.5 * u[2], min_p=0.2 * u[3],
                            repetition_penalty=0.7 + u[4], presence_penalty=2 * u[5] - 1,
                            frequency_penalty=u[6] - 0.5)
    counts = TokenCounts.of(context.tolist(), [4] * rows, vocab)
    ours = logits_to_probs(logits, params, counts)
    theirs = reference_probs(logits, context, generated, params)
    assert torch.equal(ours > 0, theirs > 0)
    assert torch.allclose(ours, theirs, atol=1e-12)
