"""``none``: proposes nothing, so every round is one plain decoding step of the target."""

from __future__ import annotations

from .api import Draft, DraftContext, Drafter


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same engine and cache (the baseline)."""

    api_version = 2  # stateless
    never_drafts = True  # the engine does not call propose

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        return Draft.empty(ctx.batch_size, device=ctx.device)
