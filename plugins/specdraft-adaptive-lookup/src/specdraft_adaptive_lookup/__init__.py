"""specdraft-adaptive-lookup: a complete, minimal third-party specdraft drafter.

It imports nothing of specdraft but the drafter API, ``specdraft.drafters.api``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from specdraft.drafters.api import Draft, DraftContext, Drafter, hookimpl, prompt_lookup


class AdaptiveLookupDrafter(Drafter):
    """Prompt lookup with a per-sequence draft length that follows the acceptance it gets."""

    api_version = 2  # state per sequence (ctx.seq_ids): sequences join and leave at any step

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        min_ngram: int = Field(1, ge=1)
        max_ngram: int = Field(3, ge=1)
        start: int = Field(3, ge=1, description="draft length of a new sequence")
        max_length: int = Field(8, ge=1, description="longest draft it will grow to")

    def reset(self) -> None:
        self.lengths: dict[int, int] = {}  # sequence id -> current draft length

    def on_leave(self, seq_id: int) -> None:
        self.lengths.pop(seq_id, None)  # the sequence has finished: forget it

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        o = self.options
        rows = []
        for seq_id, tokens in zip(ctx.seq_ids, ctx.token_ids):
            want = min(k, self.lengths.setdefault(seq_id, o.start))
            rows.append(prompt_lookup(tokens, want, o.min_ngram, o.max_ngram))
        return Draft.from_lists(rows, device=ctx.device)

    def on_verified(self, ctx: DraftContext, num_accepted: list[int]) -> None:
        # ctx.num_verified[b]: how many of row b's tokens the verifier checked (it may trim a draft)
        for seq_id, verified, accepted in zip(ctx.seq_ids, ctx.num_verified, num_accepted):
            if verified == 0:
                continue
            if accepted == verified:
                self.lengths[seq_id] = min(self.lengths[seq_id] + 2, self.options.max_length)
            else:
                self.lengths[seq_id] = max(self.lengths[seq_id] - 1, 1)


@hookimpl
def register_drafters(register):
    register("adaptive-lookup", AdaptiveLookupDrafter, aliases=("alookup",))
