"""Building tree drafts: the options tree drafters share, and helpers that assemble a
:class:`~specdraft.Draft` with ``parents`` from lists of nodes.

A tree's nodes are listed parents first (a node's parent is -1, the last committed token, or an
earlier node). The engine caps a tree at ``ctx.tree_budget`` nodes per row (chosen by its
policy, at most the drafter's ``tree_budget`` option) and at depth ``k``.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ...types import Draft

#: The most nodes a tree may have per row (a compiled runner's widest pass is 32 tokens).
MAX_TREE_BUDGET = 31
#: The most children a node of a tree may have.
MAX_TREE_WIDTH = 8


class TreeOptions(BaseModel):
    """``tree_budget`` and ``tree_width``, the options of every tree-drafting built-in."""

    model_config = ConfigDict(extra="forbid")
    tree_budget: int = Field(1, ge=1, le=MAX_TREE_BUDGET,
                             description="most draft nodes per round: several candidates verified in one pass with "
                                         "a tree mask (1: a single chain, as before); the engine's policy picks "
                                         "the budget that pays, up to this")
    tree_width: int = Field(2, ge=1, le=MAX_TREE_WIDTH, description="children per node of a tree (tree_budget > 1)")


def trie(candidates: Sequence[Sequence[int]], budget: int) -> list[tuple[int, int]]:
    """Candidate continuations, best first, merged into a prefix tree of at most ``budget`` nodes:
    ``(parent, token)`` nodes, the first candidate's line first (nodes ``0..len-1``, so a budget
    of its length is the chain drafter's own draft); shared prefixes appear once.

    >>> trie([[4, 5, 6], [4, 7], [8]], budget=5)
    [(-1, 4), (0, 5), (1, 6), (0, 7), (-1, 8)]
    >>> trie([[4, 5, 6], [4, 7], [8]], budget=4)
    [(-1, 4), (0, 5), (1, 6), (0, 7)]
    """
    nodes: list[tuple[int, int]] = []
    where: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for candidate in candidates:
        parent = -1
        for token in candidate:
            key = (parent, int(token))
            if key not in where:
                if len(nodes) >= budget:
                    return nodes
                where[key] = len(nodes)
                nodes.append(key)
            parent = where[key]
    return nodes


def tree_draft(rows: Sequence[Sequence[tuple[int, int]]], device: Any = None, probs: Any = None) -> Draft:
    """A :class:`Draft` from one list of ``(parent, token)`` nodes per row (ragged is fine);
    ``probs``: None (deterministic) or one ``[vocab]`` tensor per node per row."""
    draft = Draft.from_tree_lists(rows, device=device)
    if probs is not None and any(len(row) for row in probs):  # no node anywhere: nothing to describe
        import torch

        batch, width = draft.token_ids.shape
        vocab = next(p.shape[-1] for row in probs for p in row)
        table = torch.zeros((batch, width, vocab), dtype=next(p.dtype for row in probs for p in row),
                            device=draft.token_ids.device)
        for b, row in enumerate(probs):
            if row:
                table[b, : len(row)] = torch.stack(list(row))
        # padding nodes get a valid distribution (one-hot at their token 0) so validation passes
        table[:, :, 0] += (table.sum(-1) == 0).to(table.dtype)
        draft.probs = table
    return draft


__all__ = ["MAX_TREE_BUDGET", "TreeOptions", "tree_draft", "trie"]
