"""eagle's EAGLE-2 dynamic tree (``tree_budget`` > 1): exact, within budget and depth, and each
node drafted from its own path, as a chain along that path would draft it.

The chi-square of sampled eagle trees (with and without a copy gate) is
``tests/engine/test_tree.py::test_eagle_sampled_trees_match_the_target_law``.
"""

from __future__ import annotations

import pytest
import torch

from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.drafters.api import default_services
from specdraft.verifier import check_draft
from specdraft.sampling import logits_to_probs
from specdraft.testing import check_drafter, plain_greedy, random_heads, repetitive_prompts


@pytest.fixture(scope="module")
def eagle_heads(tiny_model, tmp_path_factory):
    return str(random_heads("eagle", tiny_model, tmp_path_factory.mktemp("eagle-tree"), scale=0.02))


def _options(heads: str, budget: int = 8, width: int = 2) -> dict:
    return {"heads": heads, "min_confidence": 0.0, "tree_budget": budget, "tree_width": width}


def test_batched_greedy_trees_equal_plain_greedy(tiny_model, eagle_heads):
    prompts = repetitive_prompts(64)[:3]  # 17, 11 and 1 tokens: the last row has no state at first
    dec = SpeculativeDecoder(tiny_model, None, drafter="eagle", spec_length=4, adaptive=False, max_batch=3,
                             drafter_options=_options(eagle_heads))
    results = dec.generate_ids(prompts, max_new_tokens=20)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(tiny_model, p, 20)
    stats = [r.stats for r in results]
    levels = sum(sum(s.drafted_per_position) for s in stats)  # the drafts' depths, summed over rounds
    assert sum(s.drafted_tokens for s in stats) > levels > 0  # more nodes per round than levels: trees
    assert sum(s.accepted_tokens for s in stats) > 0  # rolled back after partial acceptance


def test_conforms_with_trees(tiny_model, eagle_heads):
    check_drafter("eagle", tiny_model, drafter_options=_options(eagle_heads), spec_lengths=(3,))


class ChainReference:
    """Each tree node's draft distribution recomputed from scratch: the target's hidden states of
    the row (a fresh forward), every true pair through a fresh copy of the draft layer, then the
    node's path fed one pair at a time, as the chain drafter would."""

    def __init__(self, drafter, model) -> None:
        self.drafter, self.model = drafter, model
        self.runner = default_services().layer_runner(drafter.module.layer, drafter.module.llama_config, attention_norm=False)
        self.runner.cache.reset(1, 256)

    def _feed(self, features: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Pairs ``(features # [n, H], tokens)`` after the stored ones; their guessed features ``[n, H]``."""
        ids = torch.tensor([tokens], device=features.device)
        return self.runner.forward(self.drafter.module.fc_in(features[None], self.drafter.target.embeddings(ids)))[0]

    @torch.no_grad()
    def root(self, tokens: list[int]) -> torch.Tensor:
        """The guessed feature after the row's last true pair ``(f_{L-2}, x_{L-1})``.  # [H]"""
        hidden = self.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]  # [L, H]
        self.runner.cache.set_lengths([0])
        self.true_pairs = len(tokens) - 1
        return self._feed(hidden[:-1], tokens[1:])[-1]

    @torch.no_grad()
    def feature(self, root: torch.Tensor, path: list[int]) -> torch.Tensor:
        """The guessed feature after the drafted ``path`` (one pair per step, causal).  # [H]"""
        self.runner.cache.set_lengths([self.true_pairs])
        feature = root
        for token in path:
            feature = self._feed(feature[None], [token])[0]
        return feature


def _paths(parents: list[int], tokens: list[int]) -> list[list[int]]:
    """Each node's path from the root, its own token last."""
    paths: list[list[int]] = []
    for parent, token in zip(parents, tokens):
        assert -1 <= parent < len(paths)  # parents before children: the kept set is ancestor-closed
        paths.append(([] if parent < 0 else paths[parent]) + [token])
    return paths


@pytest.mark.parametrize("budget,width,params", [
    (8, 2, None),
    (5, 3, None),
    (4, 1, None),  # a chain grown through the tree passes
    (6, 2, SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.3)),
    (2, 3, SamplingParams(temperature=1.0)),  # budget below the width: one level of 2 draws
    (31, 2, SamplingParams(temperature=1.0)),
])
def test_each_node_is_drafted_from_its_own_path(tiny_model, eagle_heads, budget, width, params):
    """The tree passes' masks and positions give every node the feature a chain along its path
    would; within the budget and depth k; greedy keeps the most probable nodes, sampling every
    draw of an expanded node (reported with its distribution given its ancestors)."""
    prompts = repetitive_prompts(64)[:3]
    dec = SpeculativeDecoder(tiny_model, None, drafter="eagle", spec_length=4, adaptive=False, max_batch=3,
                             drafter_options=_options(eagle_heads, budget, width))
    drafter = dec.drafter
    reference = ChainReference(drafter, tiny_model)
    roots: list[torch.Tensor] = []
    catch_up = drafter._catch_up

    passes: list[list] = []  # per round: its tree passes' (tokens, tree_mask, guessed features)
    step = drafter.step

    def spy(*args):
        roots.append(catch_up(*args).clone())
        passes.append([])
        return roots[-1]

    def step_spy(features, tokens, slots, advance=None, tree_mask=None, depths=None):
        out = step(features, tokens, slots, advance, tree_mask, depths)
        if tree_mask is not None:
            passes[-1].append((tokens.tolist(), tree_mask.tolist(), out.clone()))
        return out

    drafter._catch_up, drafter.step = spy, step_spy
    rounds = []  # (draft, k, token_ids, counts, tree_budget) as each propose saw them
    propose = drafter.propose

    def record(ctx, k):
        draft = propose(ctx, k)
        rounds.append((draft, k, [list(t) for t in ctx.token_ids], ctx.counts, ctx.tree_budget))
        return draft

    drafter.propose = record
    branched = []  # rounds whose accepted path left the first-drafted line
    verified = drafter.on_verified

    def on_verified(ctx, num_accepted):
        branched.extend(nodes != list(range(len(nodes))) for nodes in ctx.accepted_nodes)
        return verified(ctx, num_accepted)

    drafter.on_verified = on_verified
    settings = dict(params.model_dump(), seed=budget) if params else {}
    results = dec.generate_ids(prompts, max_new_tokens=12, **settings)
    assert len(roots) == len(rounds)
    checked = 0
    for (draft, k, token_ids, counts, tree_budget), root, tree_passes in zip(rounds, roots, passes):
        assert tree_budget == budget
        ids, lengths, probs, parents = check_draft(draft, len(token_ids), k, 64, "eagle", torch.device("cpu"))
        assert parents is not None and (probs is None) == (params is None)
        for b, tokens in enumerate(token_ids):
            n = int(lengths[b])
            if len(tokens) < 2:  # no target state yet: nothing to draft from
                assert n == 0
                continue
            row_parents, row_tokens = parents[b, :n].tolist(), ids[b, :n].tolist()
            paths = _paths(row_parents, row_tokens)
            assert n <= budget and max(len(p) for p in paths) <= k
            children: dict[int, list[int]] = {}
            for i, parent in enumerate(row_parents):
                children.setdefault(parent, []).append(i)
            root_ref = reference.root(tokens)
            torch.testing.assert_close(root[b], root_ref, rtol=1e-9, atol=1e-9)  # the catch-up's true states
            fed: list[int] = []  # this round's tree nodes in the layer's cache, in order
            expanded = [()]  # the paths of the nodes the previous pass fed
            for depth, (tokens_fed, mask, out) in enumerate(tree_passes, 1):  # each sees its ancestors only
                fed += tokens_fed[b]
                now = []
                for j, visible in enumerate(mask[b]):
                    assert len(visible) == len(fed)
                    own = len(fed) - len(tokens_fed[b]) + j
                    path = [fed[c] for c in sorted({c for c, v in enumerate(visible) if v} | {own})]
                    assert len(path) == depth and tuple(path[:-1]) in expanded
                    torch.testing.assert_close(out[b, j], reference.feature(root_ref, path), rtol=1e-9, atol=1e-9)
                    now.append(tuple(path))
                expanded = now
            cum = {-1: 1.0}
            for node, kids in sorted(children.items()):
                path = [] if node < 0 else paths[node]
                logits = drafter.head(reference.feature(root_ref, path)[None])  # [1, vocab]
                if params is None:
                    q = logits.softmax(-1)[0]
                    ranked = q.topk(width).indices.tolist()
                    assert [row_tokens[i] for i in kids] == ranked[: len(kids)]  # the most likely, in order
                    for i in kids:
                        cum[i] = cum[node] * float(q[row_tokens[i]])
                else:
                    after = None if counts is None else counts.row(b).plus(torch.tensor([path]))
                    q = logits_to_probs(logits, params, after)[0]
                    assert len(kids) == min(width, budget)  # every draw kept: none dropped by its value
                    for i in kids:
                        torch.testing.assert_close(probs[b, i].to(q.dtype), q, rtol=1e-9, atol=1e-12)
                        assert q[row_tokens[i]] > 0
            if params is None:
                assert n == min(budget, width + (k - 1) * width * width)  # the budget filled, nothing orphaned
                floor = min(cum[i] for i in range(n))
                for node, kids in children.items():  # a child cut by the budget is no likelier than any kept
                    if len(kids) < width:  # (the drafter ranks in float32)
                        path = [] if node < 0 else paths[node]
                        q = drafter.head(reference.feature(root_ref, path)[None]).softmax(-1)[0]
                        assert cum[node] * float(q.topk(width).values[len(kids)]) <= floor * (1 + 1e-5)
            checked += 1
    assert checked > 3
    # the catch-up was checked after accepted paths off the first-drafted line too
    assert sum(branched) > 0 or width == 1 or budget <= width
    if params is None:
        for p, r in zip(prompts, results):
            assert r.token_ids == plain_greedy(tiny_model, p, 12)
