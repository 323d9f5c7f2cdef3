"""EAGLE-2's dynamic tree (Li et al. 2024), for any drafter that can score a node's children.

Level by level, up to depth ``k``: the ``width`` nodes of the newest level with the highest
cumulative draft probability (the product along their path) are *expanded*: the drafter feeds
them in one pass, with a tree mask so that each attends to its own ancestors among this round's
nodes and to the committed context, rotated at its own depth, and scores their children. Each
expanded node gets ``width`` children.

* Greedy: the children are the ``width`` most likely tokens; at the end every node is reranked by
  cumulative probability and the best ``budget`` are kept (a child is never more likely than its
  parent, and ties go to the parent, so the kept set holds every kept node's ancestors). Nodes
  the drafter gives less than ``min_confidence`` are dropped.
* Sampling: the children are ``width`` independent draws from the node's processed
  distribution, reported as their ``probs``, and every drawn node is kept: dropping a draw
  because of its own value (or a sibling's) would make the kept ones no longer draws from the
  reported distribution, and the multi-draft test inexact. Which nodes are expanded may depend on
  their own values: their children are drawn afterwards, given the path. The budget is met by the
  number of levels instead (``width`` nodes at the first level, ``width ** 2`` below).

The drafters plug in two callables (:func:`grow_tree`): ``eagle`` runs its draft layer on the
expanded nodes, ``draft-model`` the draft model, and ``medusa`` reads head ``level`` for every node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from ...sampling import RowSampling, TokenCounts, logits_to_probs, penalize, restrict
from ...types import Draft, DraftContext
from .base import generators
from .tree import tree_draft

if TYPE_CHECKING:  # pragma: no cover - torch is imported where it is used: listing drafters stays instant
    import torch

    from .copy_gate import CopyDrafting

#: ``next_probs(level, paths, sampling, counts) -> [batch * m, vocab]``: the draft distribution
#: after each of the ``m`` expanded nodes per row (``paths[b][j]``: node j's tokens from the root;
#: ``[[]]`` per row at level 0), processed as the target's (see :func:`processed_probs`).
NextProbs = Callable[[int, list, object, "TokenCounts | None"], "torch.Tensor"]
#: ``feed(up, tokens, tree_mask, depths)``: run the chosen nodes ``tokens # [batch, e]`` (children
#: of the previous expanded set's nodes ``up # [batch, e]``) with ``tree_mask # [batch, e, fed + e]``
#: and ``depths # [batch, e]`` (rotation offsets past the cache length), so that the next
#: ``next_probs`` scores their children.
Feed = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], None]


def processed_probs(logits: torch.Tensor, sampling, counts: TokenCounts | None, copier: CopyDrafting | None = None,
                    features: torch.Tensor | None = None, contexts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """The draft distribution ``[R, vocab]`` from ``logits # [R, vocab]``, processed as the target's
    (greedy: the penalized softmax whose top tokens are the children). With a ``copier``,
    ``logits`` are its head's own (small) logits, mixed through the copy gate on ``features # [R, H]``
    and each row's context in ``contexts``."""
    if copier is None:
        if sampling.greedy:
            return penalize(logits, sampling, counts).float().softmax(-1)
        return logits_to_probs(logits, sampling, counts)
    from .copy_gate import copy_candidates, copy_mixture

    copy_ids, match = copy_candidates(contexts, copier.gate, features.device)
    gate = copier.gated(logits, features, copy_ids, match)[1]
    full = copier.full_logits(logits)
    if sampling.greedy:
        return copy_mixture(penalize(full, sampling, counts).softmax(-1), gate, copy_ids)
    return restrict(copy_mixture(logits_to_probs(full, sampling, counts), gate, copy_ids), sampling)


def node_contexts(ctx: DraftContext, paths) -> list[list[int]]:
    """Each expanded node's context, as a copy gate reads it: its row's tokens, then its path."""
    return [list(ctx.token_ids[b]) + p for b in range(ctx.batch_size) for p in paths[b]]


def grow_tree(ctx: DraftContext, k: int, width: int, budget: int, has: Sequence[bool], next_probs: NextProbs,
              feed: Feed, min_confidence: float = 0.0) -> Draft:
    """A tree draft of at most ``budget`` nodes and depth ``k`` per row (rows where ``has[b]`` is
    false draft nothing); see the module."""
    import torch

    batch, device = ctx.batch_size, ctx.device
    greedy = ctx.sampling.greedy
    gens = generators(ctx)
    if not greedy:  # every drawn node is kept: as many levels as the budget holds
        levels, total = 0, 0
        while levels < k and total + width * (width if levels else 1) <= budget:
            total += width * (width if levels else 1)
            levels += 1
    else:
        levels = k
    if levels == 0:
        levels = 1
        width = min(width, budget)

    # each level's candidates: token, log-score, parent (index into the previous level's expanded set)
    tokens: list[torch.Tensor] = []  # per level [batch, n]
    scores: list[torch.Tensor] = []
    parent: list[torch.Tensor] = []
    probs: list[torch.Tensor | None] = []  # per level [batch, n, vocab] (sampling)
    picked: list[torch.Tensor] = []  # per level: the expanded candidates [batch, m]
    paths = [[[]] for _ in range(batch)]  # per row, per expanded node: its path's tokens
    columns = [[[]] for _ in range(batch)]  # per row, per expanded node: its ancestors' cache columns
    base = ctx.counts
    fed = 0
    for level in range(levels):
        m = len(paths[0])
        rows = batch * m
        sampling = ctx.sampling.rows(rows) if isinstance(ctx.sampling, RowSampling) else ctx.sampling
        counts = None
        if base is not None:
            index = torch.arange(batch, device=device).repeat_interleave(m)
            drafted = torch.tensor([p for row in paths for p in row], dtype=torch.long, device=device)
            counts = base.select(index).plus(drafted.view(rows, level))
        q = next_probs(level, paths, sampling, counts)  # [rows, vocab]
        before = scores[-1].gather(1, picked[-1]) if scores else torch.zeros((batch, 1), device=device)
        if greedy:
            top, ids = q.topk(width, dim=-1)  # [rows, width]
            probs.append(None)
        else:
            row_gens = gens if isinstance(gens, list) else [gens] * batch
            ids = torch.cat([torch.multinomial(q[b * m : (b + 1) * m], width, replacement=True, generator=row_gens[b])
                             for b in range(batch)])  # [rows, width]
            top = q.gather(1, ids)
            probs.append(q.view(batch, m, 1, -1).expand(-1, -1, width, -1).reshape(batch, m * width, -1))
        tokens.append(ids.view(batch, m * width))
        scores.append((before[:, :, None] + top.float().clamp_min(1e-30).log().view(batch, m, width)).view(batch, -1))
        parent.append(torch.arange(m, device=device).repeat_interleave(width).expand(batch, -1))
        if greedy:  # a doubted guess is not proposed, nor anything below it
            scores[-1] = torch.where(top.view(batch, -1) >= min_confidence, scores[-1], -torch.inf)
        if level + 1 == levels:
            break
        # expand the best of this level in one pass: each node sees its own ancestors
        expand = min(width, tokens[-1].shape[1])
        chosen = scores[-1].topk(expand, dim=-1).indices.sort(dim=-1).values  # [batch, expand]
        picked.append(chosen)
        up = parent[-1].gather(1, chosen)  # [batch, expand] index into the previous expanded set
        chosen_ids = tokens[-1].gather(1, chosen)
        mask = torch.zeros((batch, expand, fed + expand), dtype=torch.bool)
        new_paths, new_columns = [], []
        ups, toks = up.tolist(), chosen_ids.tolist()
        for b in range(batch):
            row_paths, row_columns = [], []
            for j in range(expand):
                cols = columns[b][ups[b][j]] + [fed + j]
                mask[b, j, cols] = True
                row_paths.append(paths[b][ups[b][j]] + [toks[b][j]])
                row_columns.append(cols)
            new_paths.append(row_paths)
            new_columns.append(row_columns)
        # stored after the fed nodes, rotated at the committed length + level
        depths = torch.full((batch, expand), level - fed, dtype=torch.long, device=device)
        feed(up, chosen_ids, mask.to(device), depths)
        fed += expand
        paths, columns = new_paths, new_columns
    return _assemble(tokens, scores, parent, probs, picked, budget, greedy, has, device)


def _assemble(tokens, scores, parent, probs, picked, budget, greedy, has, device) -> Draft:
    """The levels' candidates as a :class:`~specdraft.Draft` tree, per row: greedy, the ``budget``
    best by cumulative score; sampling, every one (the levels were sized to the budget)."""
    batch = tokens[0].shape[0]
    levels = len(tokens)
    tok = [t.tolist() for t in tokens]
    sc = [s.tolist() for s in scores]
    par = [p.tolist() for p in parent]
    pick = [p.tolist() for p in picked]
    rows, row_probs = [], []
    for b in range(batch):
        if not has[b]:
            rows.append([])
            row_probs.append([])
            continue
        # (level, index) -> its parent (level - 1, index) or None; only expanded candidates have children
        cands = []
        for level in range(levels):
            for i, token in enumerate(tok[level][b]):
                up = None if level == 0 else (level - 1, pick[level - 1][b][par[level][b][i]])
                cands.append((level, i, up, token, sc[level][b][i]))
        live = [c for c in cands if c[4] > -float("inf")]
        if greedy:
            live.sort(key=lambda c: (-c[4], c[0], c[1]))
            live = live[:budget]
        keep = {(c[0], c[1]) for c in live}
        kept = sorted((c for c in live if c[2] is None or c[2] in keep), key=lambda c: (c[0], c[1]))
        number = {}
        nodes, kept_probs = [], []
        for c in kept:
            if c[2] is not None and c[2] not in number:
                continue  # its parent was dropped
            number[(c[0], c[1])] = len(nodes)
            nodes.append((-1 if c[2] is None else number[c[2]], c[3]))
            if probs[c[0]] is not None:
                kept_probs.append(probs[c[0]][b, c[1]])
        rows.append(nodes)
        row_probs.append(kept_probs)
    return tree_draft(rows, device=device, probs=None if greedy else row_probs)


__all__ = ["grow_tree", "node_contexts", "processed_probs"]
