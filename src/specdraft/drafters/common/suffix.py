"""Bounded-depth suffix tries for suffix decoding (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975).

A :class:`SuffixTrie` holds every window of at most ``max_depth`` tokens of the sequences put in
it: the path of node ``v`` is a window, ``v.count`` how many times that window occurs (at any
position of any sequence), ``v.out`` the sum of its children's counts (how many of those
occurrences have a next token). Windows never span two sequences.

* :class:`SuffixStream` is one growing sequence (a request's prompt + output) with its own trie:
  appending a token updates the ``max_depth`` nodes of the sequence's current suffixes, O(depth).
* :class:`SharedSuffix` holds finished sequences (earlier requests' outputs) up to a number of
  tokens, evicting the oldest sequence's windows (counts decremented, empty nodes removed); a
  lock makes it safe to add to and draft from in several threads.

Drafting (:meth:`SuffixTrie.draft`): find the longest suffix of the context that occurs in the
trie with a continuation (match length ``m``), then grow a tree below it best first by path
probability (the product of ``child.count / parent.out`` along the path), at most ``budget``
nodes, ``width`` children per node, depth ``min(k, ceil(alpha * m))``.

Pure Python, no torch.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import deque
from itertools import count as _counter
from typing import Iterable, Sequence


class Node:
    """A trie node: ``count`` occurrences of its path, ``out`` of them continued, ``children``
    (token -> node, None while it has none)."""

    __slots__ = ("count", "out", "children")

    def __init__(self) -> None:
        self.count = 0
        self.out = 0
        self.children: dict[int, Node] | None = None

    def child(self, token: int) -> "Node | None":
        return self.children.get(token) if self.children else None


#: A drafted tree: ``(parent, token)`` nodes, parents first; and its score (sum of path probabilities:
#: the expected number of accepted tokens if the frequencies were the truth)
Tree = tuple[list[tuple[int, int]], float]


class SuffixTrie:
    """Counts of every window of at most ``max_depth`` tokens of the sequences added.

    >>> t = SuffixTrie(4)
    >>> t.add([1, 2, 3, 1, 2, 4, 1, 2])
    >>> t.counts([1, 2])            # (occurrences, of which continued) of the window 1 2
    (3, 2)
    >>> t.longest_match([9, 1, 2])  # "1 2" occurs with a continuation; "9 1 2" does not
    2
    >>> t.draft([9, 1, 2], k=4, budget=3, width=2, alpha=1.0)[0]  # depth <= alpha * 2
    [(-1, 3), (-1, 4), (0, 1)]
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, not {max_depth}")
        self.max_depth = max_depth
        self.root = Node()
        self.size = 1  # nodes, the root included

    # -- updates -------------------------------------------------------------------------------
    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count (``sign=1``) or uncount (``sign=-1``: a sequence added before) every window of
        ``tokens``: O(max_depth) per token. Nodes whose count drops to 0 are removed."""
        tokens = list(tokens)
        n, depth = len(tokens), self.max_depth
        for i in range(n):
            self._walk(tokens, i, min(n, i + depth), sign)

    def _walk(self, tokens: list[int], start: int, end: int, sign: int) -> None:
        node = self.root
        node.count += sign
        for j in range(start, end):
            token = tokens[j]
            children = node.children
            child = children.get(token) if children is not None else None
            if child is None:
                if sign < 0:
                    raise ValueError("removing a sequence that was not added")
                child = Node()
                if children is None:
                    children = node.children = {}
                children[token] = child
                self.size += 1
            child.count += sign
            node.out += sign
            if child.count == 0:  # so is every node below it: they go with it
                del children[token]
                if not children:
                    node.children = None
                self.size -= 1
            node = child

    # -- queries -------------------------------------------------------------------------------
    def find(self, path: Sequence[int]) -> Node | None:
        """The node of ``path`` (the root for ``[]``), or None if it never occurred."""
        node = self.root
        for token in path:
            node = node.child(token)
            if node is None:
                return None
        return node

    def counts(self, path: Sequence[int]) -> tuple[int, int]:
        """``(occurrences, continued occurrences)`` of the window ``path`` (0, 0 if none)."""
        node = self.find(path)
        return (node.count, node.out) if node is not None else (0, 0)

    def longest_match(self, context: Sequence[int]) -> int:
        """The longest ``m <= max_depth - 1`` such that the last ``m`` tokens of ``context`` occur
        with a continuation (0: not even the last token has).

        Matching is monotone (a window that occurs continued has every suffix of it occurring
        continued), so a binary search over ``m`` walks O(max_depth log max_depth) nodes.
        """
        lo, hi = 0, min(len(context), self.max_depth - 1)
        n = len(context)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self.find(context[n - mid:])
            if node is not None and node.out > 0:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def grow(self, anchor: Node, depth: int, budget: int, width: int, min_prob: float = 0.0) -> Tree:
        """A tree below ``anchor``, best first by path probability: at most ``budget`` nodes of
        depth ``<= depth``, each node's ``width`` most frequent continuations considered, none of
        path probability below ``min_prob``. Siblings come most likely first, so each node's first
        child is its most frequent continuation. Returns ``(nodes, score)``."""
        nodes: list[tuple[int, int]] = []
        score = 0.0
        if depth < 1 or budget < 1:
            return nodes, score
        tie = _counter()
        heap: list = []

        def push(node: Node, prob: float, parent: int, level: int) -> None:
            if not node.children or node.out <= 0:
                return
            ranked = sorted(node.children.items(), key=lambda kv: (-kv[1].count, kv[0]))[:width]
            for token, child in ranked:
                p = prob * child.count / node.out
                if p >= min_prob:
                    heapq.heappush(heap, (-p, next(tie), token, child, parent, level))

        push(anchor, 1.0, -1, 1)
        while heap and len(nodes) < budget:
            neg, _, token, child, parent, level = heapq.heappop(heap)
            index = len(nodes)
            nodes.append((parent, token))
            score += -neg
            if level < depth:
                push(child, -neg, index, level + 1)
        return nodes, score

    def draft(self, context: Sequence[int], k: int, budget: int, width: int, alpha: float, min_match: int = 1,
              min_prob: float = 0.0) -> Tree:
        """A tree continuing ``context``: match its longest suffix (``m`` tokens, at least
        ``min_match``), then :meth:`grow` to depth ``min(k, ceil(alpha * m))``.

        The trie holds windows of ``max_depth`` tokens, so a path below an anchor of ``a`` tokens
        reaches ``max_depth - a`` deep: the anchor is the last ``min(m, max_depth - depth)``
        tokens (a shorter suffix counts a superset of the occurrences)."""
        m = self.longest_match(context)
        if m < max(1, min_match):
            return [], 0.0
        depth = min(k, max(1, math.ceil(alpha * m)))
        a = max(1, min(m, self.max_depth - depth))
        anchor = self.find(context[len(context) - a:])
        if anchor is None:  # cannot happen: suffixes of a match match
            return [], 0.0
        return self.grow(anchor, depth, budget, width, min_prob)


class SuffixStream:
    """One growing sequence and the trie of its windows, updated in O(max_depth) per token.

    >>> s = SuffixStream(4)
    >>> s.extend([1, 2, 3, 1, 2])
    >>> s.trie.counts([1, 2]), s.trie.counts([2, 3, 1, 2])
    ((2, 1), (1, 0))
    """

    def __init__(self, max_depth: int, tokens: Iterable[int] = ()) -> None:
        self.trie = SuffixTrie(max_depth)
        self.tokens: list[int] = []
        self._active: list[Node] = []  # nodes of the suffixes of 1 .. max_depth - 1 tokens, shortest first
        self.extend(tokens)

    def append(self, token: int) -> None:
        trie = self.trie
        keep = trie.max_depth - 1
        root = trie.root
        root.count += 1
        new: list[Node] = []
        for node in [root, *self._active]:  # suffix of L tokens -> suffix of L + 1 tokens
            children = node.children
            child = children.get(token) if children is not None else None
            if child is None:
                child = Node()
                if children is None:
                    children = node.children = {}
                children[token] = child
                trie.size += 1
            child.count += 1
            node.out += 1
            if len(new) < keep:
                new.append(child)
        self._active = new
        self.tokens.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(int(token))


class SharedSuffix:
    """Finished sequences' windows, at most ``max_tokens`` tokens of them, oldest evicted first;
    thread-safe (one lock around every update and query).

    >>> shared = SharedSuffix(max_depth=4, max_tokens=6)
    >>> shared.add([1, 2, 3]); shared.add([4, 5, 6]); shared.trie.counts([1, 2])
    (1, 1)
    >>> shared.add([7, 8]); shared.tokens, shared.trie.counts([1, 2])  # [1, 2, 3] evicted
    (5, (0, 0))
    """

    def __init__(self, max_depth: int, max_tokens: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.max_tokens = max_tokens
        self.sequences: deque[list[int]] = deque()
        self.tokens = 0
        self.lock = threading.Lock()

    def add(self, tokens: Sequence[int]) -> None:
        """Add one finished sequence (its last ``max_tokens`` tokens, if longer), then evict the
        oldest sequences while over the bound."""
        tokens = [int(t) for t in tokens]
        if self.max_tokens <= 0 or not tokens:
            return
        tokens = tokens[-self.max_tokens:]
        with self.lock:
            self.trie.add(tokens)
            self.sequences.append(tokens)
            self.tokens += len(tokens)
            while self.tokens > self.max_tokens:
                old = self.sequences.popleft()
                self.trie.add(old, sign=-1)
                self.tokens -= len(old)

    def draft(self, context: Sequence[int], k: int, budget: int, width: int, alpha: float, min_match: int = 1,
              min_prob: float = 0.0) -> Tree:
        """:meth:`SuffixTrie.draft` under the lock."""
        with self.lock:
            if not self.sequences:
                return [], 0.0
            return self.trie.draft(context, k, budget, width, alpha, min_match, min_prob)


__all__ = ["Node", "SharedSuffix", "SuffixStream", "SuffixTrie"]
