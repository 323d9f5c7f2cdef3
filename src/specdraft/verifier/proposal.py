"""A drafter's draft, checked once and made into the :class:`Proposal` the verifier runs.

:func:`make_proposal` is the one place a :class:`~specdraft.Draft` is validated against its
contract (:func:`check_draft`), cut to each row's cap, and told apart: a chain, or a tree with its
:class:`TreeShape`. What comes after (the pass, acceptance) reads the proposal, never the draft.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DrafterError
from ..types import Draft
from .tree import first_chain, tree_ancestors, tree_structure


#: ``SPECDRAFT_DEBUG=1``: validate every draft in full (values, not just shapes), at the cost of
#: device-to-host copies each round. The conformance suite always does.
DEBUG = os.environ.get("SPECDRAFT_DEBUG", "") not in ("", "0")


def check_draft(draft: Any, batch: int, k: int, vocab: int, who: str, device: torch.device, full: bool = True):
    """Validate a drafter's output against the :class:`Draft` contract.

    Returns ``(token_ids # [batch, n], lengths # [batch], probs # [batch, n, vocab] | None,
    parents # [batch, n] | None)`` on ``device`` (``parents`` None: a chain); raises
    :class:`DrafterError` naming ``who`` on any violation. Without ``full`` only types and shapes
    are checked (nothing is copied from the device): what the hot path does; a tree's malformed
    nodes are then dropped (:func:`~specdraft.verifier.tree.tree_structure`) instead of reported.
    """

    def bad(msg: str) -> DrafterError:
        return DrafterError(f"drafter {who} returned an invalid draft: {msg}")

    if not isinstance(draft, Draft):
        raise bad(f"expected a specdraft.Draft, got {type(draft).__name__}")
    ids = draft.token_ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise bad("token_ids must be an integer tensor of shape [batch, k']")
    parents = draft.parents
    if parents is not None:
        if not isinstance(parents, torch.Tensor) or parents.dtype not in (torch.int64, torch.int32):
            raise bad("parents must be an integer tensor of shape [batch, n] (or None for a chain)")
        if parents.shape != ids.shape:
            raise bad(f"parents has shape {tuple(parents.shape)}, expected token_ids' {tuple(ids.shape)}")
        parents = parents.to(device=device, dtype=torch.long)
    if ids.shape[0] != batch or (parents is None and ids.shape[1] > k):
        raise bad(f"token_ids has shape {tuple(ids.shape)}, expected [{batch}, <= {k}]")
    ids = ids.to(device=device, dtype=torch.long)
    width = ids.shape[1]
    if draft.lengths is None:
        lengths = torch.full((batch,), width, dtype=torch.long, device=device)
    else:
        lengths = torch.as_tensor(draft.lengths).to(device=device, dtype=torch.long)
        if lengths.shape != (batch,):
            raise bad(f"lengths must be [batch] with values in 0..{width}")
    probs = draft.probs
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
            raise bad("probs must be a floating-point tensor or None")
        if probs.shape != (batch, width, vocab):
            raise bad(f"probs has shape {tuple(probs.shape)}, expected [{batch}, {width}, {vocab}]")
        probs = probs.to(device)
    if not full:  # on the device, without a copy: a draft stops before its first id outside the vocabulary
        valid_ids = ((ids >= 0) & (ids < vocab)).long().cumprod(dim=1).sum(dim=1)  # [batch]
        return ids.clamp(0, vocab - 1), torch.minimum(lengths.clamp(0, width), valid_ids), probs, parents
    _check_values(ids, lengths, probs, parents, k, vocab, bad)
    return ids, lengths, probs, parents


def _check_values(ids: torch.Tensor, lengths: torch.Tensor, probs: torch.Tensor | None, parents: torch.Tensor | None,
                  k: int, vocab: int, bad) -> None:
    """:func:`check_draft`'s full checks, of values (each copies from the device): lengths in range,
    a tree's parents and depth, ids in the vocabulary, draft distributions that are distributions
    giving their own tokens a chance. ``bad(message)`` makes the error raised."""
    width, device = ids.shape[1], ids.device
    if bool((lengths < 0).any()) or bool((lengths > width).any()):
        raise bad(f"lengths must be [batch] with values in 0..{width}")
    valid = torch.arange(width, device=device) < lengths[:, None]  # [batch, k']
    if parents is not None:
        columns = torch.arange(width, device=device)
        wrong = valid & ((parents < -1) | (parents >= columns))
        if bool(wrong.any()):
            b, i = (int(x) for x in wrong.nonzero()[0])
            raise bad(f"parents[{b}, {i}] is {int(parents[b, i])}; a node's parent must be -1 (the last committed "
                      f"token) or an earlier node (0..{i - 1})")
        depths, _ = tree_structure(parents, lengths)
        deepest = int(depths.max()) if depths.numel() else 0
        if deepest > k:
            raise bad(f"the tree is {deepest} levels deep; at most k = {k} (the draft length asked for)")
    real = ids[valid]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab):
        raise bad(f"token ids must lie in [0, {vocab}); got {int(real.min())}..{int(real.max())}")
    if probs is not None:
        rows = probs[valid].double()  # [n_valid, vocab]
        if rows.numel():
            if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()):
                raise bad("probs must be finite and non-negative")
            sums = rows.sum(-1)
            if bool(((sums - 1).abs() > 1e-3).any()):
                raise bad(f"each probs row must sum to 1 (got sums from {float(sums.min()):.4f} to {float(sums.max()):.4f})")
            if bool((rows.gather(1, real[:, None]) <= 0).any()):
                raise bad("a drafted token has probability 0 under its own draft distribution")


@dataclass
class TreeShape:
    """What a tree draft's verify pass and acceptance need, over pass indices ``0..n`` (0: the
    last committed token, ``i + 1``: node ``i``)."""

    parents: torch.Tensor  # [batch, n] long: node i's parent node (-1: the root)
    valid: torch.Tensor  # [batch, n] bool: the node is real (within its row's length, under a valid parent, not too deep)
    ancestors: torch.Tensor  # [batch, n + 1, n + 1] bool: the pass's tree mask (a pass index sees itself and its ancestors)
    depths: torch.Tensor  # [batch, n] long: 1 for the root's children, 0 for invalid nodes


@dataclass
class Proposal:
    """One round's drafts, validated: what the verify pass runs after each row's last token.

    A chain when ``tree`` is None: row ``b``'s tokens are ``token_ids[b, :lengths[b]]``. A tree
    otherwise: ``lengths[b]`` is its number of valid nodes, ``tree`` says where they hang.
    """

    token_ids: torch.Tensor  # [batch, width] long, in [0, vocab)
    lengths: torch.Tensor  # [batch] long: a chain's tokens, a tree's valid nodes (what was verified)
    draft_probs: torch.Tensor | None  # [batch, width, vocab], or None: every token deterministic (one-hot)
    tree: TreeShape | None = None
    caps: list[int] | None = None  # on the host: the most tokens (levels) row b may have; sizes its random draws

    @property
    def width(self) -> int:
        return self.token_ids.shape[1]

    @property
    def depths(self) -> torch.Tensor:
        """Each row's levels verified: a chain's length, a tree's deepest valid node.  # [batch]"""
        return self.lengths if self.tree is None else self.tree.depths.max(1).values

    @property
    def pass_depths(self) -> torch.Tensor:
        """How many tokens after the row's next one each pass index's logits predict  # [batch, width + 1]:
        index ``j`` of a chain ``j``, a tree node's its depth (index 0, the last committed token, 0).
        What padding and invalid nodes get does not matter: acceptance never reads their logits."""
        batch = self.token_ids.shape[0]
        if self.tree is None:
            return torch.arange(self.width + 1, device=self.token_ids.device).expand(batch, -1)
        return torch.cat([torch.zeros_like(self.tree.depths[:, :1]), self.tree.depths], 1)

    def pass_inputs(self, last: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The verify pass ``[last, d_1..d_width]  # [batch, width + 1]`` after each row's last
        committed token ``last # [batch, 1]``, and the runner's tree arguments (none for a chain)."""
        tokens = torch.cat([last, self.token_ids], dim=1)
        if self.tree is None:
            return tokens, {}
        return tokens, {"tree_mask": self.tree.ancestors, "depths": torch.cat([torch.zeros_like(last), self.tree.depths], 1)}

    def counts_along(self, counts):
        """The penalties' context at each pass index (a :class:`~specdraft.sampling.TokenCounts`
        of the batch's rows, or None)."""
        if counts is None:
            return None
        return counts.along(self.token_ids) if self.tree is None else counts.along_tree(self.token_ids, self.tree.ancestors)


def _with_predicted(ids, lengths, probs, parents, predicted: dict[int, list[int]]):
    """The draft's tensors with rows ``predicted`` replaced by those deterministic chains: one-hot
    rows where the drafter reported probabilities, a chain's parents where it drafted a tree."""
    batch, width = ids.shape
    wide = max(width, max(len(tokens) for tokens in predicted.values()))
    ids = torch.cat([ids, ids.new_zeros((batch, wide - width))], 1)
    lengths = lengths.clone()
    if probs is not None:
        probs = torch.cat([probs, probs.new_zeros((batch, wide - width, probs.shape[-1]))], 1)
    if parents is not None:
        parents = torch.cat([parents, torch.arange(width, wide, device=ids.device).expand(batch, -1) - 1], 1)
    for b, tokens in predicted.items():
        row = torch.tensor(tokens, dtype=torch.long, device=ids.device)
        ids[b] = 0
        ids[b, : len(tokens)] = row
        lengths[b] = len(tokens)
        if probs is not None:
            probs[b] = 0
            probs[b, torch.arange(len(tokens), device=ids.device), row] = 1
        if parents is not None:
            parents[b] = torch.arange(wide, device=ids.device) - 1
    return ids, lengths, probs, parents


def _width_on_cpu(used: torch.Tensor, width: int) -> int:
    """No wider a pass than the largest draft: free to know on a CPU, a copy on a GPU (which keeps
    ``width``)."""
    return int(used.max()) if used.device.type == "cpu" and used.numel() else width


def empty_proposal(batch: int, device) -> Proposal:
    """No draft: the round is a plain one-token step."""
    return Proposal(torch.zeros((batch, 0), dtype=torch.long, device=device),
                    torch.zeros(batch, dtype=torch.long, device=device), None, caps=[0] * batch)


def make_proposal(draft: Any, caps: list[int], vocab: int, who: str, device, *, full: bool = True,
                  trees: bool = True, predicted: dict[int, list[int]] | None = None) -> Proposal:
    """The :class:`Proposal` of a drafter's ``draft`` for rows capped at ``caps[b]`` tokens (or
    levels) each: validated (:func:`check_draft`; :class:`DrafterError` naming ``who``), a chain cut
    to its caps, a tree's nodes deeper than its cap dropped, and no wider than its widest row.
    ``trees=False`` (a runner that cannot verify trees): a tree is verified as its first chain.
    ``predicted``: rows that draft from their request's prediction instead (row -> token ids, at
    most its cap; ``draft`` may be None when every drafting row is one of them)."""
    if draft is None:
        draft = Draft.empty(len(caps), device)
    ids, lengths, probs, parents = check_draft(draft, len(caps), max(caps, default=0), vocab, who, device, full=full)
    if predicted:
        ids, lengths, probs, parents = _with_predicted(ids, lengths, probs, parents, predicted)
    caps_t = torch.tensor(caps, device=device)
    if parents is not None and ids.shape[1] == 0:  # an empty tree is an empty chain
        parents = None
    if parents is not None:
        ancestors, valid, depths = tree_ancestors(parents, lengths, max_depth=caps_t)
        if not trees:
            ids, lengths, probs = first_chain(ids, parents, valid, probs)
            parents = None
    if parents is None:
        lengths = torch.minimum(lengths, caps_t)
        used = lengths
    else:
        used = torch.where(valid, torch.arange(ids.shape[1], device=device) + 1, 0).max(1).values
    width = _width_on_cpu(used, ids.shape[1])
    ids, probs = ids[:, :width], None if probs is None else probs[:, :width]
    caps = list(caps)
    if parents is None:
        return Proposal(ids, lengths, probs, caps=caps)
    lengths = valid[:, :width].sum(1)
    if not width:  # nothing valid was drafted: a plain step
        return Proposal(ids, lengths, probs, caps=caps)
    return Proposal(ids, lengths, probs, TreeShape(parents[:, :width], valid[:, :width],
                                                   ancestors[:, : width + 1, : width + 1], depths[:, :width]), caps)
