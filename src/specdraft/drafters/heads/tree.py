"""Tree drafting for the heads: ``eagle`` (EAGLE-2's dynamic tree) and ``medusa`` (top-k per
head, the product pruned to the budget), both grown by :func:`~specdraft.drafters.api.grow_tree`.

* eagle: each expanded node is fed to the draft layer as the pair (its parent's guessed feature,
  its token), with a tree mask and rotated at its own depth; its children come from the head on
  the guessed feature. The layer cache needs no cleanup: the next proposal rolls the rows back
  to their true pairs.
* medusa: head ``i`` guesses position ``i + 1`` from the newest target state alone, so every node
  at depth ``i`` has the same candidates (the ``tree_width`` best of head ``i``, or draws from it)
  and the tree is their product, the paths with the highest product of the heads' probabilities
  kept. Penalties and a copy gate make a node's distribution depend on its path, as in a chain.
"""

from __future__ import annotations

import torch

from ..api import DraftContext, grow_tree, node_contexts, processed_probs


def eagle_tree(drafter, ctx: DraftContext, k: int, root: torch.Tensor, slots: list[int]):
    """A tree draft from each row's newest guessed feature ``root # [batch, H]``; see the module."""
    copier = drafter.copier
    state = {"features": root[:, None]}  # [batch, m, H] the expanded nodes' guessed features

    def next_probs(level, paths, sampling, counts):
        features = state["features"].reshape(-1, root.shape[-1])
        if copier is None:
            return processed_probs(drafter.head(features), sampling, counts)
        return processed_probs(drafter.head.small(features), sampling, counts, copier, features,
                               node_contexts(ctx, paths))

    def feed(up, tokens, tree_mask, depths):
        features = state["features"]
        inputs = features.gather(1, up[:, :, None].expand(-1, -1, features.shape[-1]))  # the parents' features
        state["features"] = drafter.step(inputs, tokens, slots, tree_mask=tree_mask, depths=depths)

    return grow_tree(ctx, k, drafter.options.tree_width, ctx.tree_budget, drafter.has_state, next_probs, feed,
                     drafter.options.min_confidence)


def medusa_tree(drafter, ctx: DraftContext, m: int, features: torch.Tensor):
    """A tree draft from the heads' features ``# [batch, m, H]`` (head i's at ``[:, i]``); see the module."""
    copier = drafter.copier if drafter.module.own_heads is None else None  # own heads: no gate, as in a chain
    logits = drafter.module.logits(features, drafter.head) if copier is None else None  # [batch, m, vocab]

    def next_probs(level, paths, sampling, counts):
        n = len(paths[0])  # expanded nodes per row: each has head ``level``'s candidates
        if copier is None:
            return processed_probs(logits[:, level].repeat_interleave(n, 0), sampling, counts)
        rows = features[:, level].repeat_interleave(n, 0)
        return processed_probs(drafter.head.small(rows), sampling, counts, copier, rows,
                               node_contexts(ctx, paths))

    def feed(up, tokens, tree_mask, depths):  # the heads read the target's state alone: nothing to run
        pass

    return grow_tree(ctx, m, drafter.options.tree_width, ctx.tree_budget, drafter.has_state, next_probs, feed,
                     drafter.options.min_confidence)


__all__ = ["eagle_tree", "medusa_tree"]
