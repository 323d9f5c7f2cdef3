"""``prompt-lookup``: copy what followed the last earlier occurrence of the trailing n-gram."""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from .api import Draft, DraftContext, Drafter, TreeOptions, lookup, lookup_all, prompt_lookup, tree_draft, trie


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding (Saxena, 2023) over prompt + output, per row. With ``tree_budget``
    > 1, the continuations of up to ``tree_width`` earlier matches are merged into a tree."""

    api_version = 2  # stateless: reads ctx.token_ids only

    class Options(TreeOptions):
        model_config = ConfigDict(extra="forbid")
        min_ngram: int = Field(1, ge=1, description="shortest trailing n-gram to look up")
        max_ngram: int = Field(3, ge=1, description="longest trailing n-gram to look up")

        @model_validator(mode="after")
        def _range(self):
            if self.min_ngram > self.max_ngram:
                raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
            return self

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        o = self.options
        if ctx.tree_budget > 1:  # several earlier matches as branches
            trees = [trie(lookup_all(tokens, k, o.min_ngram, o.max_ngram, o.tree_width), ctx.tree_budget)
                     if ctx.active[b] else [] for b, tokens in enumerate(ctx.token_ids)]
            return tree_draft(trees, device=ctx.device)
        rows = [
            prompt_lookup(tokens, k, o.min_ngram, o.max_ngram) if ctx.active[b] else []
            for b, tokens in enumerate(ctx.token_ids)
        ]
        return Draft.from_lists(rows, device=ctx.device)


#: ``prompt_lookup`` (and its helpers) stay importable from here, where plugins found them before the drafter API
__all__ = ["PromptLookupDrafter", "lookup", "lookup_all", "prompt_lookup"]
