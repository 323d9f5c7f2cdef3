"""N-gram lookup over a token sequence: what followed earlier occurrences of its trailing n-gram.

Pure functions on lists of token ids (numpy inside, no torch). ``prompt-lookup`` drafts with
them, the copy gate of the learnt drafters reads its candidate from :func:`lookup`, and a
third-party drafter gets them from :mod:`specdraft.drafters.api`.
"""

from __future__ import annotations

from typing import Sequence


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


__all__ = ["lookup", "lookup_all", "prompt_lookup"]
