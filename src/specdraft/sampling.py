"""Sampling settings and the logits -> probabilities processing shared by target and drafters.

Exactness needs the *same* processing on both sides: the verifier runs the target's
logits through :func:`logits_to_probs`, and a drafter that samples (a draft model, heads)
must draw its tokens from ``logits_to_probs(its_logits, ctx.sampling)`` and report those
rows as ``Draft.probs``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # pragma: no cover
    import torch


class SamplingParams(BaseModel):
    """Temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 disable those filters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass to keep; 1.0 = off")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: "torch.Tensor", params: SamplingParams) -> "torch.Tensor":
    """Apply temperature, then top-k, then top-p, and softmax.

    logits  # [..., vocab]
    returns # [..., vocab], rows sum to 1; filtered tokens have probability exactly 0.

    Top-k keeps every token whose logit is >= the k-th largest (ties are kept). Top-p keeps
    the smallest prefix of tokens, in descending order, whose mass reaches ``top_p`` (the
    most likely token is always kept). Greedy settings give a one-hot at the argmax.
    """
    import torch

    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def draw(logits: "torch.Tensor", params: SamplingParams, generator: "torch.Generator | None" = None):
    """One draft token per row from ``logits # [batch, vocab]``, the way drafters must draw it.

    Returns ``(tokens # [batch], probs # [batch, vocab] | None)``: the argmax and None when
    greedy, else a sample from ``logits_to_probs(logits, params)`` and those probabilities
    (what the drafter reports as ``Draft.probs``).
    """
    import torch

    if params.greedy:
        return logits.argmax(-1), None
    probs = logits_to_probs(logits.float(), params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1), probs
