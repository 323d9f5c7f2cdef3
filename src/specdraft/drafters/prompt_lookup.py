"""``prompt-lookup``: copy what followed the last earlier occurrence of the trailing n-gram."""

from __future__ import annotations

from typing import Sequence

from pydantic import ConfigDict, Field, model_validator

from ..types import Draft, DraftContext
from .base import Drafter
from .tree import TreeOptions, tree_draft, trie


def prompt_lookup(tokens: Sequence[int], k: int, min_ngram: int = 1, max_ngram: int = 3) -> list[int]:
    """Find the most recent earlier occurrence of the trailing n-gram and return what followed.

    n goes from ``max_ngram`` down to ``min_ngram``; the first n with a match wins, and up
    to ``k`` tokens after the match are returned (fewer near the end). The trailing
    n-gram itself does not count as an occurrence.

    >>> prompt_lookup([1, 2, 3, 4, 9, 1, 2, 3], k=2)           # "1 2 3" was followed by "4 9"
    [4, 9]
    >>> prompt_lookup([7, 1, 5, 2, 1, 5, 3, 1, 5], k=3)        # most recent "1 5" wins
    [3, 1, 5]
    >>> prompt_lookup([7, 1, 5, 2, 6, 5], k=2)                 # only "5" matches (n=1)
    [2, 6]
    >>> prompt_lookup([7, 1, 5, 2, 6, 5], k=2, min_ngram=2)
    []
    """
    return lookup(tokens, k, min_ngram, max_ngram)[0]


def lookup(tokens: Sequence[int], k: int, min_ngram: int = 1, max_ngram: int = 3) -> tuple[list[int], int]:
    """:func:`prompt_lookup` plus the length n of the n-gram that matched (0: no match).

    >>> lookup([1, 2, 3, 4, 9, 1, 2, 3], k=1)
    ([4], 3)
    >>> lookup([7, 1, 5, 2, 6, 5], k=2)
    ([2, 6], 1)
    """
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        # windows start at 0..length-1-n, so the trailing n-gram (start length-n) is excluded
        windows = sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist(), n
    return [], 0


def lookup_all(tokens: Sequence[int], k: int, min_ngram: int = 1, max_ngram: int = 3, limit: int = 4) -> list[list[int]]:
    """Up to ``limit`` different continuations of earlier occurrences of the trailing n-gram, best
    first: longer n-grams first, the most recent occurrence first within one n (the first is
    :func:`prompt_lookup`'s). What a tree drafts: the branches the text offers.

    >>> lookup_all([1, 2, 3, 1, 2, 4, 1, 2], k=2)
    [[4, 1], [3, 1]]
    """
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    found: list[list[int]] = []
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        windows = sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        for hit in hits[::-1]:
            start = int(hit) + n
            follow = arr[start : start + k].tolist()
            if follow and follow not in found:
                found.append(follow)
                if len(found) >= limit:
                    return found
    return found


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
