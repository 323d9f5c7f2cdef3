"""Exact acceptance of a tree of drafted tokens, as pure tensor functions.

A tree draft has n nodes per row; ``parents[b, i]`` is node i's parent (-1: the root, the last
committed token, which the verify pass feeds first), always an earlier node. The verify pass is
``[root, node 0, ..., node n-1]``: pass index ``j = i + 1`` is node ``i``, index 0 the root.

Greedy: the walk from the root takes, at each node, the child whose token is the target's argmax
there. Sampling: SpecInfer's multi-draft speculative sampling (Miao et al. 2024), children tried in
a fixed order, the residual after each rejection (see :func:`tree_rejection_sample`). Arithmetic
in float32, or float64 for float64 inputs, as in :mod:`.chain`.
"""

from __future__ import annotations

import torch

from ..sampling import compute_dtype, sample_rows
from .chain import normalized


def tree_ancestors(parents: torch.Tensor, lengths: torch.Tensor,
                   max_depth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The structure of a batch of trees ``parents # [batch, n]`` with ``lengths # [batch]`` real nodes.

    Returns ``(ancestors # [batch, n+1, n+1] bool, valid # [batch, n] bool, depths # [batch, n])`` over
    pass indices: ``ancestors[b, j, m]`` is True when ``m`` is ``j`` or one of its ancestors (the
    verify pass's tree mask); a node is valid when it is within its row's length, its parent is -1
    or an earlier node, and its parent is valid, and (with ``max_depth # [batch]``) it is at most
    that deep; ``depths`` is 1 for the root's children (0 for invalid nodes). Computed on the
    device by squaring the reachability matrix (log2 n products).
    """
    batch, n = parents.shape
    device = parents.device
    nodes = torch.arange(n, device=device)
    ok = (nodes < lengths[:, None]) & (parents >= -1) & (parents < nodes)  # [batch, n]
    up = torch.where(ok, parents + 1, nodes + 1)  # each pass index's parent; a malformed node its own
    reach = torch.zeros((batch, n + 1, n + 1), dtype=torch.float32, device=device)
    reach[:, torch.arange(n + 1, device=device), torch.arange(n + 1, device=device)] = 1.0
    reach[:, 1:].scatter_(2, up[:, :, None], 1.0)  # [j, parent(j)]
    steps = 1
    while steps < n + 1:  # after this, reach holds paths of every length up to n
        reach = (reach @ reach).clamp_max(1.0)
        steps *= 2
    ancestors = reach > 0
    valid = ancestors[:, 1:, 0]  # reaches the root through valid parents only
    if max_depth is not None:  # a node deeper than its row's cap goes, and so do its descendants
        valid = valid & (ancestors[:, 1:, 1:].sum(-1) <= max_depth[:, None])
    ancestors = ancestors & torch.cat([torch.ones_like(valid[:, :1]), valid], 1)[:, :, None]  # drop invalid rows
    eye = torch.eye(n + 1, dtype=torch.bool, device=device)
    ancestors = ancestors | eye  # an invalid node still sees itself (its output is never used)
    depths = torch.where(valid, ancestors[:, 1:, 1:].sum(-1), 0)
    return ancestors, valid, depths


def tree_structure(parents: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(depths # [batch, n], valid # [batch, n])`` of :func:`tree_ancestors`."""
    _, valid, depths = tree_ancestors(parents, lengths)
    return depths, valid


def greedy_tree_accept(
    draft_token_ids: torch.Tensor,  # [batch, n]
    parents: torch.Tensor,  # [batch, n]
    valid: torch.Tensor,  # [batch, n] bool
    target_token_ids: torch.Tensor,  # [batch, n + 1] the target's argmax at each pass index
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree from the root, at every node taking the (first) child whose token is the
    target's argmax there.

    Returns ``(num_accepted # [batch], next_token # [batch], path # [batch, n])``: the accepted
    nodes in order (root's child first) fill ``path[b, :num_accepted[b]]`` (the rest is ``n``),
    and ``next_token`` is the target's argmax after the last of them.
    """
    batch, n = draft_token_ids.shape
    up = (parents + 1).clamp(0, n)  # pass index of each node's parent
    on = torch.zeros((batch, n + 1), dtype=torch.bool, device=draft_token_ids.device)  # on the accepted path
    on[:, 0] = True
    for i in range(n):  # parents come first, so a node's parent is decided before it
        p = up[:, i : i + 1]
        ok = valid[:, i] & (draft_token_ids[:, i] == target_token_ids.gather(1, p)[:, 0]) & on.gather(1, p)[:, 0]
        if i:  # an earlier sibling with the same token was taken already
            ok &= ~((up[:, :i] == p) & on[:, 1 : i + 1]).any(1)
        on[:, i + 1] = ok
    num_accepted = on[:, 1:].sum(1)
    nodes = torch.arange(n, device=on.device).expand(batch, n)
    path = torch.where(on[:, 1:], nodes, n).sort(1).values  # an ancestor has a smaller index than its child
    last = torch.where(num_accepted > 0, path.gather(1, (num_accepted - 1).clamp_min(0)[:, None])[:, 0] + 1, 0)
    return num_accepted, target_token_ids.gather(1, last[:, None])[:, 0], path


def tree_rejection_sample(
    draft_token_ids: torch.Tensor,  # [n] one row
    parents: torch.Tensor,  # [n]
    valid: torch.Tensor,  # [n] bool
    draft_probs: torch.Tensor | None,  # [n, vocab] or None (every node one-hot)
    target_probs: torch.Tensor,  # [n + 1, vocab] at each pass index
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Multi-draft speculative sampling down one row's tree (SpecInfer, Miao et al. 2024):
    the output is distributed exactly as the target's.

    At a node with target distribution ``p`` its children are tried in order: child ``c``
    (token ``x``, drawn from ``q_c``) is accepted with probability ``min(1, p(x) / q_c(x))``, and
    the walk moves to it; after a rejection ``p <- norm(max(p - q_c, 0))``. When every child is
    rejected (or the node has none) the next token is drawn from ``p``. Children must have been
    drawn independently given their ancestors (siblings may share ``q`` and repeat a token) or
    be deterministic (``q`` one-hot); the order in which they are tried is fixed before any draw,
    which is all the proof needs. Arithmetic in float32 (float64 for float64 inputs).

    Returns ``(path, next_token)``: the accepted nodes, root's child first, and the token after them.
    """
    dtype = compute_dtype(target_probs.dtype if draft_probs is None
                          else torch.promote_types(target_probs.dtype, draft_probs.dtype))
    device = target_probs.device
    target_probs = normalized(target_probs.to(dtype))
    if draft_probs is not None:
        draft_probs = normalized(draft_probs.to(device=device, dtype=dtype))
    tokens, ups, real = draft_token_ids.tolist(), parents.tolist(), valid.tolist()
    children: dict[int, list[int]] = {}
    for i, (parent, ok) in enumerate(zip(ups, real)):
        if ok:
            children.setdefault(parent, []).append(i)
    node, path = -1, []
    p = target_probs[0]
    while True:
        for c in children.get(node, ()):
            x = tokens[c]
            q_x = 1.0 if draft_probs is None else draft_probs[c, x]
            u = torch.rand((), generator=generator, device=device, dtype=dtype)
            if bool(u * q_x < p[x]):  # u < p(x)/q(x), without dividing
                path.append(c)
                node, p = c, target_probs[c + 1]
                break
            if draft_probs is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = (p - draft_probs[c]).clamp_min(0.0)
            mass = residual.sum()
            # mass is 0 only if p equals q_c, where rejection has probability 0
            p = residual / mass if bool(mass > 0) else p
        else:  # no child accepted: the token after the path comes from what is left of p
            return path, int(sample_rows(p[None], generator)[0])


def first_chain(draft_token_ids: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A tree cut down to one chain (each node's first valid child, from the root), for a target
    whose runner cannot verify trees: ``(token_ids # [batch, k'], lengths # [batch], probs | None)``.
    Exact either way: the chain's tokens were drawn from the same distributions."""
    rows = []
    for ups, ok in zip(parents.tolist(), valid.tolist()):
        chain, node = [], -1
        for i, (parent, real) in enumerate(zip(ups, ok)):
            if real and parent == node:
                chain.append(i)
                node = i
        rows.append(chain)
    width = max((len(r) for r in rows), default=0)
    index = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long,
                         device=draft_token_ids.device).view(len(rows), width)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=draft_token_ids.device)
    probs = None if draft_probs is None else draft_probs.gather(
        1, index[:, :, None].expand(-1, -1, draft_probs.shape[-1]))
    return draft_token_ids.gather(1, index), lengths, probs
