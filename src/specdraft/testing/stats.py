"""The statistics of specdraft's sampled tests, and how many samples each one draws.

A sampled test runs ``n`` speculative samples of the first ``K + 1`` tokens (so the first
round drafts ``K`` tokens and rejection, the residual and the bonus token are exercised at
every draft position) and compares them with the target's exact distribution, enumerated
independently of specdraft's code (:mod:`specdraft.testing.reference`), by chi-square tests
of each position's marginal, each pair of adjacent positions and the whole joint, combined by
Bonferroni at :data:`SIGNIFICANCE`.

**Power.** ``n`` is chosen so that the marginal test of any one position detects a deviation
of Cohen's effect size :data:`EFFECT` (``w = sqrt(sum (p_i - q_i)^2 / q_i)``; 0.1 is, for
example, 2.5 percentage points of probability moved between two tokens of probability 1/8)
with probability :data:`POWER`, at the Bonferroni-corrected level: the chi-square statistic
of a deviation of size ``w`` follows a non-central chi-square with ``df`` degrees of freedom
and non-centrality ``n w^2``, and :func:`samples_needed` finds the smallest ``n`` whose
non-central tail beyond the critical value is at least :data:`POWER`. For a 16-token
vocabulary and 4 steps (8 tests) that is about 5,000 samples. Larger deviations (a
temperature off by 20%, a wrong row at draft position 2) are detected with far fewer.
"""

from __future__ import annotations

import math
from typing import Sequence

#: Significance level of specdraft's statistical tests. Their seeds are fixed, so a run is
#: deterministic; the level says how far from the target a sampler may drift and still pass.
SIGNIFICANCE = 1e-3
#: The smallest deviation (Cohen's w) every position's marginal test must detect ...
EFFECT = 0.1
#: ... with this probability.
POWER = 0.9


def chi_square_sf(stat: float, dof: float) -> float:
    """P(chi-square with ``dof`` degrees of freedom > ``stat``)."""
    import torch

    if stat <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _critical_value(dof: int, alpha: float) -> float:
    """The ``stat`` with ``chi_square_sf(stat, dof) == alpha`` (bisection)."""
    lo, hi = 0.0, dof + 10.0
    while chi_square_sf(hi, dof) > alpha:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi_square_sf(mid, dof) > alpha else (lo, mid)
    return hi


def _noncentral_sf(stat: float, dof: int, noncentrality: float) -> float:
    """P(non-central chi-square > ``stat``): a Poisson(noncentrality / 2) mixture of central ones."""
    half = noncentrality / 2
    terms = int(half + 12 * math.sqrt(half) + 60)
    return sum(math.exp(-half + j * math.log(half) - math.lgamma(j + 1)) * chi_square_sf(stat, dof + 2 * j)
               for j in range(terms)) if half > 0 else chi_square_sf(stat, dof)


def samples_needed(dof: int, tests: int = 1, effect: float = EFFECT, power: float = POWER,
                   alpha: float = SIGNIFICANCE) -> int:
    """The smallest sample size at which a chi-square test with ``dof`` degrees of freedom, at
    level ``alpha / tests`` (Bonferroni), detects a deviation of Cohen's ``effect`` with
    probability ``power``."""
    critical = _critical_value(max(dof, 1), alpha / tests)
    lo, hi = 0.0, 1.0
    while _noncentral_sf(critical, max(dof, 1), hi) < power:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _noncentral_sf(critical, max(dof, 1), mid) < power else (lo, mid)
    return math.ceil(hi / effect**2)


def chi_square_pvalue(observed, expected_probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value (cells with small expectation are pooled)."""
    import torch

    observed = torch.as_tensor(observed, dtype=torch.float64).flatten()
    probs = torch.as_tensor(expected_probs, dtype=torch.float64).flatten()
    n = observed.sum()
    expected = probs * n
    if bool((observed[expected == 0] > 0).any()):
        return 0.0  # a sample where the target puts no mass: certainly wrong
    big = expected >= min_expected
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    return chi_square_sf(stat, dof)


def samples_pvalue(samples, exact) -> float:
    """p-value of ``samples # [n, steps]`` (token ids) against ``exact`` (an
    :class:`~specdraft.testing.reference.Enumerated`): chi-square tests of each position's
    marginal, each adjacent pair and the whole joint, combined by Bonferroni
    (``min(1, tests * smallest p)``). A sample the target cannot emit gives 0."""
    import torch

    samples = torch.as_tensor(samples, dtype=torch.long)
    steps, vocab = exact.steps, exact.vocab
    assert samples.shape[1] == steps, f"samples of {samples.shape[1]} tokens against a joint of {steps}"
    index = {tuple(s): i for i, s in enumerate(exact.sequences.tolist())}
    where = [index.get(tuple(s)) for s in samples.tolist()]
    if any(w is None for w in where):
        return 0.0
    joint = torch.bincount(torch.tensor(where), minlength=len(index))
    pvalues = [chi_square_pvalue(joint, exact.probs)]
    for i in range(steps):
        pvalues.append(chi_square_pvalue(torch.bincount(samples[:, i], minlength=vocab), exact.marginal(i)))
    for i in range(steps - 1):
        cells = samples[:, i] * vocab + samples[:, i + 1]
        pvalues.append(chi_square_pvalue(torch.bincount(cells, minlength=vocab**2), exact.pair(i, i + 1)))
    return min(1.0, len(pvalues) * min(pvalues))


def family_size(steps: int) -> int:
    """How many chi-square tests :func:`samples_pvalue` combines for ``steps`` tokens."""
    return 1 + steps + max(steps - 1, 0)


def sampled_joint_pvalue(decoder, prompt: Sequence[int], params, n: int | None = None, seed: int = 0,
                         exact=None, steps: int | None = None, max_new_tokens: int | None = None,
                         prediction: Sequence[int] | None = None):
    """p-value of the first ``steps`` tokens of ``n`` speculative samples from ``decoder`` (one
    batched call, ``prompt`` repeated) against the target's exact distribution (by default
    enumerated from its plain decoding as it runs: :func:`~specdraft.testing.models.plain_reference`).

    ``steps`` defaults to the decoder's ``spec_length + 1``, so the first round drafts (and
    verifies) as deep as the decoder drafts at all; ``n`` defaults to :func:`samples_needed` for
    the largest marginal support (see the module's docstring). ``exact`` may pass an
    :class:`~specdraft.testing.reference.Enumerated` computed once by
    :func:`~specdraft.testing.reference.enumerate_plain_sampling`. ``max_new_tokens``
    (default ``steps``) generates more, so later rounds run too. Returns ``(p_value, results)``;
    compare the p-value with :data:`SIGNIFICANCE`. ``prediction``: every sample's predicted output
    (token ids), drafted from before the drafter.
    """
    from .models import plain_reference
    from .reference import enumerate_plain_sampling

    steps = steps or decoder.engine.spec_length + 1
    if exact is None:
        exact = enumerate_plain_sampling(plain_reference(decoder), prompt, params, steps)
    if n is None:
        support = max(int((exact.marginal(i) > 0).sum()) for i in range(steps))
        n = samples_needed(support - 1, family_size(steps))
    results = decoder.generate_ids([list(prompt)] * n, max_new_tokens=max(steps, max_new_tokens or steps), seed=seed,
                                   prediction=None if prediction is None else [list(prediction)] * n,
                                   **params.model_dump())
    short = [r for r in results if len(r.token_ids) < steps]
    assert not short, f"{len(short)} of {n} samples ended before {steps} tokens ({short[0].finish_reason})"
    return samples_pvalue([r.token_ids[:steps] for r in results], exact), results
