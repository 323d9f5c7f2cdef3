"""The statistics of specdraft's sampled tests."""

from __future__ import annotations

from typing import Sequence

#: Significance level of specdraft's statistical tests. Their seeds are fixed, so a run is
#: deterministic; the level says how far from the target a sampler may drift and still pass.
SIGNIFICANCE = 1e-3



def sampled_joint_pvalue(decoder, prompt: Sequence[int], params, n: int = 12_000, seed: int = 0,
                         exact=None, steps: int = 2, max_new_tokens: int | None = None):
    """p-value of the first ``steps`` tokens of ``n`` speculative samples from ``decoder`` (one
    batched call, ``prompt`` repeated) against the target's exact joint distribution.

    Chi-square tests of the joint and of each token's marginal (a marginal has far fewer cells,
    so far more power against a skewed distribution; the joint catches dependence between the
    tokens), combined by Bonferroni: ``min(1, tests * smallest p)``. Returns
    ``(p_value, results)``; compare the p-value with :data:`SIGNIFICANCE`. ``exact`` may pass a
    joint computed once by :func:`exact_joint_distribution`. ``max_new_tokens`` (default
    ``steps``): generate more, so that the first round may draft deeper than ``steps - 1``.
    """
    import torch

    exact = exact_joint_distribution(decoder.model, prompt, params, steps) if exact is None else exact
    results = decoder.generate_ids([list(prompt)] * n, max_new_tokens=max(steps, max_new_tokens or steps), seed=seed,
                                   **params.model_dump())
    counts = torch.zeros_like(exact)
    for r in results:
        counts[tuple(r.token_ids[:steps])] += 1
    pvalues = [chi_square_pvalue(counts, exact)]
    for i in range(steps):
        others = [d for d in range(steps) if d != i]
        pvalues.append(chi_square_pvalue(counts.sum(others), exact.sum(others)))
    return min(1.0, len(pvalues) * min(pvalues)), results


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
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))
