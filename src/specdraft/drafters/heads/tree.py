"""EAGLE-2's dynamic tree (Li et al. 2024) for the ``eagle`` drafter.

Level by level, up to depth ``k``: the ``tree_width`` nodes of the newest level with the highest
cumulative draft probability (the product along their path) are *expanded*: fed to the draft
layer in one pass, each as the pair (its parent's guessed feature, its token), with a tree mask
so that it attends to its own ancestors among this round's nodes and to the committed context,
and rotated at its own depth. Each expanded node gets ``tree_width`` children.

* Greedy: the children are the ``tree_width`` most likely tokens; at the end every node is
  reranked by cumulative probability and the best ``ctx.tree_budget`` are kept (a child is never
  more likely than its parent, and ties go to the parent, so the kept set holds every kept
  node's ancestors). Nodes the drafter gives less than ``min_confidence`` are dropped.
* Sampling: the children are ``tree_width`` independent draws from the node's processed
  distribution, reported as their ``probs``, and every drawn node is kept: dropping a draw
  because of its own value (or a sibling's) would make the kept ones no longer draws from the
  reported distribution, and the multi-draft test inexact. The budget is met by the number of
  levels instead (``tree_width`` nodes at the first level, ``tree_width ** 2`` below).

The layer cache needs no cleanup: the next proposal rolls the rows back to their true pairs.
"""

from __future__ import annotations

import torch

from ...sampling import RowSampling, TokenCounts, logits_to_probs, penalize, restrict
from ...types import DraftContext
from ..base import generators
from ..copy_gate import copy_candidates, copy_mixture
from ..tree import tree_draft


def node_probs(drafter, features: torch.Tensor, contexts, sampling, counts: TokenCounts | None) -> torch.Tensor:
    """The draft distribution after each of ``features # [R, H]`` (a node's guessed feature; its
    row's context plus path in ``contexts``): processed as the target's, through the copy gate if
    the heads have one. Greedy: the (penalized) softmax whose top tokens are the children.  # [R, vocab]"""
    copier = drafter.copier
    if copier is None:
        logits = drafter.head(features)
        if sampling.greedy:
            return penalize(logits, sampling, counts).float().softmax(-1)
        return logits_to_probs(logits, sampling, counts)
    small = drafter.head.small(features)
    copy_ids, match = copy_candidates(contexts, copier.gate, features.device)
    gate = copier.gated(small, features, copy_ids, match)[1]
    full = copier.full_logits(small)
    if sampling.greedy:
        return copy_mixture(penalize(full, sampling, counts).softmax(-1), gate, copy_ids)
    return restrict(copy_mixture(logits_to_probs(full, sampling, counts), gate, copy_ids), sampling)


def eagle_tree(drafter, ctx: DraftContext, k: int, root: torch.Tensor, slots: list[int]):
    """A tree draft from each row's newest guessed feature ``root # [batch, H]``; see the module."""
    batch, device = ctx.batch_size, root.device
    width, budget = drafter.options.tree_width, ctx.tree_budget
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
    features = root[:, None]  # [batch, m, H] the expanded nodes' guessed features
    base = ctx.counts
    fed = 0
    for level in range(levels):
        m = features.shape[1]
        rows = batch * m
        sampling = ctx.sampling.rows(rows) if isinstance(ctx.sampling, RowSampling) else ctx.sampling
        counts = None
        if base is not None:
            index = torch.arange(batch, device=device).repeat_interleave(m)
            drafted = torch.tensor([p for row in paths for p in row], dtype=torch.long, device=device)
            counts = base.select(index).plus(drafted.view(rows, level))
        contexts = None if drafter.copier is None else [list(ctx.token_ids[b]) + p for b in range(batch)
                                                          for p in paths[b]]
        q = node_probs(drafter, features.reshape(rows, -1), contexts, sampling, counts)  # [rows, vocab]
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
        confident = top.view(batch, -1) >= drafter.options.min_confidence if greedy else None
        if greedy:  # a doubted guess is not proposed, nor anything below it
            scores[-1] = torch.where(confident, scores[-1], -torch.inf)
        if level + 1 == levels:
            break
        # expand the best of this level: one pass of the draft layer, each sees its own ancestors
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
        inputs = features.gather(1, up[:, :, None].expand(-1, -1, features.shape[-1]))  # parents' features
        depths = torch.full((batch, expand), level - fed, dtype=torch.long, device=device)  # position pairs + level
        features = drafter._step(inputs, chosen_ids, slots, tree_mask=mask.to(device), depths=depths)
        fed += expand
        paths, columns = new_paths, new_columns
    return _assemble(tokens, scores, parent, probs, picked, budget, greedy, drafter._has, device)


def _assemble(tokens, scores, parent, probs, picked, budget, greedy, has, device):
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
        nodes, node_probs_ = [], []
        for c in kept:
            if c[2] is not None and c[2] not in number:
                continue  # its parent was dropped
            number[(c[0], c[1])] = len(nodes)
            nodes.append((-1 if c[2] is None else number[c[2]], c[3]))
            if probs[c[0]] is not None:
                node_probs_.append(probs[c[0]][b, c[1]])
        rows.append(nodes)
        row_probs.append(node_probs_)
    return tree_draft(rows, device=device, probs=None if greedy else row_probs)


__all__ = ["eagle_tree", "node_probs"]
