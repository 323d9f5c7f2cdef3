"""Exact acceptance of a chain of drafted tokens, as pure tensor functions.

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):

* **accepted tokens** -- the longest prefix of the draft that passes the test;
* **recovered token** -- at the first rejected position, a token drawn from the residual
  ``norm(max(0, target_probs - draft_probs))`` (greedy: the target's argmax);
* **bonus token** -- when all drafts are accepted, a token drawn from the target's
  distribution at the position after the last draft.

Every round therefore emits ``num_accepted + 1`` tokens. ``draft_probs=None`` means a
deterministic draft (n-gram, prompt lookup): it is the one-hot distribution at the
drafted token, so the test accepts with probability ``target_probs[d]`` and the residual
is the target distribution with ``d`` removed.

All arithmetic (the ratio test, the uniforms, the residual) runs in float32, or float64 when
the probabilities come in float64, whatever dtype they arrive in: in bfloat16 a uniform has
128 values in [0.5, 1) and a probability of 0.998 rounds to 1.0, which biases acceptance.
"""

from __future__ import annotations

import torch

from ..sampling import compute_dtype, inverse_cdf, row_uniforms


def _valid_mask(num_draft_tokens: torch.Tensor, k: int) -> torch.Tensor:
    # num_draft_tokens [batch] -> [batch, k] True where the column holds a real draft
    return torch.arange(k, device=num_draft_tokens.device) < num_draft_tokens[:, None]


def normalized(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)  # padding rows may be 0


def greedy_accept(
    draft_token_ids: torch.Tensor,  # [batch, k]
    num_draft_tokens: torch.Tensor,  # [batch]
    target_token_ids: torch.Tensor,  # [batch, k + 1] argmax of the target at each position
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix where the draft equals the target's argmax.

    Returns ``(num_accepted # [batch], next_token # [batch])`` where ``next_token`` is the
    target's argmax after the accepted prefix (the recovered or bonus token).
    """
    k = draft_token_ids.shape[1]
    matches = (draft_token_ids == target_token_ids[:, :k]) & _valid_mask(num_draft_tokens, k)
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [batch]
    next_token = target_token_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [batch, k]
    num_draft_tokens: torch.Tensor,  # [batch]
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] or None (one-hot drafts)
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    generator=None,
    draws: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: output tokens are distributed exactly as ``target_probs``.

    Draft ``i`` is accepted with probability ``min(1, target_probs[i, d_i] / draft_probs[i, d_i])``.
    At the first rejection a recovered token is drawn from the residual; if all of a row's
    drafts pass, a bonus token is drawn from ``target_probs[num_draft_tokens]``.

    ``generator``: one, None, or a list with one per row. Row ``b`` draws ``draws[b]`` uniforms
    (:func:`~specdraft.sampling.row_uniforms`; at least ``num_draft_tokens[b] + 1``, known on the
    host, default exactly that, read from the tensor): column ``i`` for draft ``i``'s test, column
    ``num_draft_tokens[b]`` for the token after them (:func:`~specdraft.sampling.inverse_cdf`),
    never one a test used, so every draw is independent; a row's numbers depend on its own
    ``draws`` only, never on the batch's width.

    Returns ``(num_accepted # [batch], next_token # [batch])``.
    """
    dtype = compute_dtype(target_probs.dtype if draft_probs is None
                          else torch.promote_types(target_probs.dtype, draft_probs.dtype))
    # renormalized in that dtype: rows that arrive rounded (bfloat16) sum to 1 only roughly, and
    # the test is exact for the distributions the rows describe (what the last draw samples from)
    target_probs = normalized(target_probs.to(dtype))
    draft_probs = normalized(draft_probs.to(device=target_probs.device, dtype=dtype)) if draft_probs is not None else None
    batch, k = draft_token_ids.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    lengths = num_draft_tokens.to(device=device, dtype=torch.long)
    uniform = row_uniforms(generator, (lengths + 1).tolist() if draws is None else draws, device)  # float64
    if k:
        target_at_draft = target_probs[:, :k].gather(2, draft_token_ids[..., None]).squeeze(2)  # [batch, k]
        if draft_probs is None:
            draft_at_draft = torch.ones_like(target_at_draft)
        else:
            draft_at_draft = draft_probs.gather(2, draft_token_ids[..., None]).squeeze(2)
        tests = torch.nn.functional.pad(uniform[:, :k], (0, max(k - uniform.shape[1], 0)))  # past a draft: masked
        # u < t/d  <=>  u * d < t, in float64 (d > 0 for every drafted token: the draft was sampled from it)
        accepted = (tests * draft_at_draft.double() < target_at_draft.double()) & _valid_mask(lengths, k)
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=device)

    final_probs = target_probs[rows, num_accepted]  # [batch, vocab]
    rejected = num_accepted < lengths  # [batch]
    if k:  # the residual of every row, used where it rejected (no copy from the device to ask whether any did)
        at = num_accepted.clamp(max=max(k - 1, 0))
        if draft_probs is None:
            residual = final_probs.clone()
            residual[rows, draft_token_ids[rows, at]] = 0.0
        else:
            residual = (final_probs - draft_probs[rows, at]).clamp_min(0.0)
        mass = residual.sum(dim=1, keepdim=True)
        # mass is 0 only if the target equals the draft, where rejection has probability 0
        residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), final_probs)
        final_probs = torch.where(rejected[:, None], residual, final_probs)
    next_token = inverse_cdf(final_probs, uniform.gather(1, lengths[:, None]).squeeze(1))
    return num_accepted, next_token
