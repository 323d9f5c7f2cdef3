"""``ngram``: an FNV-1a hashed n-gram predictor that learns from the request as it goes."""

from __future__ import annotations

import functools
from collections import deque
from itertools import islice
from typing import Iterable, Sequence

from pydantic import ConfigDict, Field, model_validator

from .api import Draft, DraftContext, Drafter, TreeOptions, row_ids, tree_draft, trie

FNV_OFFSET_BASIS = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def fnv1a_64(tokens: Iterable[int]) -> int:
    """64-bit FNV-1a over the 4 little-endian bytes of each token id.

    >>> hex(fnv1a_64([]))          # the offset basis
    '0xcbf29ce484222325'
    >>> fnv1a_64([1, 2]) == fnv1a_64([2, 1])
    False
    """
    h = FNV_OFFSET_BASIS
    for token in tokens:
        for shift in (0, 8, 16, 24):
            h ^= (token >> shift) & 0xFF
            h = (h * FNV_PRIME) & _MASK64
    return h


@functools.lru_cache(maxsize=1 << 16)
def _context_hash(context: tuple[int, ...]) -> int:
    """:func:`fnv1a_64` of a context (a drafter's contexts repeat: the same few tokens, row after row)."""
    return fnv1a_64(context)


def _tail(tokens, n: int) -> list[int]:
    """The last ``n`` of ``tokens`` (a list or a deque, read from its end: a deque has no slices)."""
    return list(islice(reversed(tokens), n))[::-1]


class NGramPredictor:
    """Counts which token follows each context of 1..3 tokens and chains predictions.

    An order-``n`` table maps the FNV-1a hash of ``n - 1`` context tokens to the counts of
    the tokens seen after it, and remembers the most frequent one (ties go to the most
    recent). Prediction uses the longest context that has been seen. Tokens stream through
    a sliding history of ``history`` tokens; the tables are never pruned.

    Worked example: after ``5 6 7 5 6 8 5 6`` the trailing 3-token context ``8 5 6`` is
    new, so the 2-token context ``5 6`` decides; it was followed once by 7 and once by 8,
    and the tie goes to the more recent 8. Chaining then sees ``5 6 8`` (followed by 5),
    ``6 8 5`` (followed by 6), and ``8 5 6`` falls back to ``5 6`` again:

    >>> p = NGramPredictor()
    >>> p.extend([5, 6, 7, 5, 6, 8, 5, 6])
    >>> p.predict(4)
    [8, 5, 6, 8]
    >>> p.predict_next([7])       # 1-token context: 7 was followed by 5
    5
    >>> p.predict_next([9]) is None
    True
    """

    def __init__(self, min_order: int = 2, max_order: int = 4, history: int = 512) -> None:
        self.orders = range(max_order, min_order - 1, -1)  # longest context first
        # order -> {context hash: [counts {token: n}, best token, best count]}
        self.tables: dict[int, dict[int, list]] = {order: {} for order in self.orders}
        self.history: deque[int] = deque(maxlen=history)
        self.max_context = max_order - 1

    def add(self, token: int) -> None:
        """Count ``token`` after every context the history ends with, then append it."""
        tail = tuple(_tail(self.history, self.max_context))
        for order, table in self.tables.items():
            n = order - 1
            if len(tail) < n:
                continue
            entry = table.setdefault(_context_hash(tail[len(tail) - n:]), [{}, -1, 0])
            counts = entry[0]
            count = counts[token] = counts.get(token, 0) + 1
            if count >= entry[2]:
                entry[1], entry[2] = token, count
        self.history.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.add(token)

    def predict_next(self, context: Sequence[int]) -> int | None:
        """Most frequent continuation of the longest matching suffix of ``context``."""
        for order, table in self.tables.items():
            n = order - 1
            if len(context) < n:
                continue
            entry = table.get(_context_hash(tuple(context[len(context) - n:])))
            if entry is not None:
                return entry[1]
        return None

    def top_next(self, context: Sequence[int], width: int) -> list[int]:
        """Up to ``width`` continuations of ``context``, best first: the longest matching
        context's most frequent ones (its best first), then shorter contexts' for the rest.

        >>> p = NGramPredictor()
        >>> p.extend([5, 6, 7, 5, 6, 8, 5, 6, 8, 1, 6, 9])
        >>> p.top_next([5, 6], 3)
        [8, 7, 9]
        """
        out: list[int] = []
        for order, table in self.tables.items():
            n = order - 1
            if len(context) < n:
                continue
            entry = table.get(_context_hash(tuple(context[len(context) - n:])))
            if entry is None:
                continue
            ranked = sorted(entry[0], key=lambda t: (t != entry[1], -entry[0][t]))
            out += [t for t in ranked if t not in out][: width - len(out)]
            if len(out) >= width:
                break
        return out

    def predict(self, k: int, context: Sequence[int] | None = None) -> list[int]:
        """Chain up to ``k`` predictions, each appended to the context of the next (after the
        history, or after ``context``)."""
        context = _tail(self.history if context is None else context, self.max_context)
        out: list[int] = []
        for _ in range(k):
            token = self.predict_next(context)
            if token is None:
                break
            out.append(token)
            context = (context + [token])[-self.max_context:]
        return out


def ngram_tree(predictor: NGramPredictor, k: int, budget: int, width: int) -> list[tuple[int, int]]:
    """The chained prediction, plus at each of its levels the runner-up continuations, each
    followed by its own chained prediction: ``(parent, token)`` nodes, at most ``budget``."""
    history = list(predictor.history)
    main = predictor.predict(k)
    candidates = [main]
    for depth in range(len(main)):
        context = history + main[:depth]
        for token in predictor.top_next(context, width)[1:]:
            rest = predictor.predict(k - depth - 1, context + [token]) if depth + 1 < k else []
            candidates.append(main[:depth] + [token] + rest)
    return trie(candidates, budget)


class NGramDrafter(Drafter):
    """Drafts by chaining an :class:`NGramPredictor` seeded with the prompt.

    Each sequence has its own predictor; it is fed the prompt on first sight and then every
    accepted token (including the target's correction/bonus token) before each proposal. With
    ``tree_budget`` > 1 the runner-up continuations at each level branch off (:func:`ngram_tree`).
    """

    api_version = 2

    class Options(TreeOptions):
        model_config = ConfigDict(extra="forbid")
        min_order: int = Field(2, ge=2, description="shortest n-gram (context of n-1 tokens)")
        max_order: int = Field(4, ge=2, le=8, description="longest n-gram")
        history: int = Field(512, ge=8, description="sliding history window, in tokens")

        @model_validator(mode="after")
        def _orders(self):
            if self.min_order > self.max_order:
                raise ValueError(f"min_order ({self.min_order}) must be <= max_order ({self.max_order})")
            return self

    def reset(self) -> None:
        self._seqs: dict[int, tuple[NGramPredictor, int]] = {}  # sequence id -> (predictor, tokens fed)

    def on_leave(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def _sync(self, seq_id: int, tokens: list[int]) -> NGramPredictor:
        predictor, seen = self._seqs.get(seq_id, (None, 0))
        if predictor is None:
            o = self.options
            predictor = NGramPredictor(o.min_order, o.max_order, o.history)
        predictor.extend(tokens[seen:])
        self._seqs[seq_id] = (predictor, len(tokens))
        return predictor

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        if ctx.tree_budget > 1:  # the runner-up continuations as branches
            o = self.options
            trees = [ngram_tree(self._sync(seq_id, tokens), k, ctx.tree_budget, o.tree_width) if ctx.active[b] else []
                     for b, (seq_id, tokens) in enumerate(zip(row_ids(ctx), ctx.token_ids))]
            return tree_draft(trees, device=ctx.device)
        rows = [
            self._sync(seq_id, tokens).predict(k) if ctx.active[b] else []
            for b, (seq_id, tokens) in enumerate(zip(row_ids(ctx), ctx.token_ids))
        ]
        return Draft.from_lists(rows, device=ctx.device)
