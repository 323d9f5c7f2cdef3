"""Tree speculation: several candidates verified in one pass with a tree mask, exact for greedy
and for sampling (multi-draft rejection), and the accepted path kept in the cache."""

from __future__ import annotations

import random

import pytest
import torch

from specdraft import Draft, Drafter, GenerationSettings, SpeculativeDecoder
from specdraft.verifier.tree import first_chain, greedy_tree_accept, tree_ancestors, tree_rejection_sample
from specdraft.errors import DrafterError
from specdraft.sampling import SamplingParams, logits_to_probs
from specdraft.testing import SIGNIFICANCE as ALPHA
from specdraft.testing import chi_square_pvalue, plain_greedy, repetitive_prompts, sampled_joint_pvalue


# -- the pure functions ------------------------------------------------------------------------


def test_tree_structure_depths_ancestors_and_invalid_nodes():
    parents = torch.tensor([[-1, -1, 0, 2, 1, -1], [-1, 0, 1, 7, 0, -3]])
    ancestors, valid, depths = tree_ancestors(parents, torch.tensor([6, 5]))
    assert valid.tolist() == [[True] * 6, [True, True, True, False, True, False]]
    assert depths.tolist() == [[1, 1, 2, 3, 2, 1], [1, 2, 3, 0, 2, 0]]
    # node 3 of row 0 (pass index 4) sees the root, node 0, node 2 and itself
    assert ancestors[0, 4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    capped = tree_ancestors(parents, torch.tensor([6, 5]), max_depth=torch.tensor([1, 2]))[1]
    assert capped.tolist() == [[True, True, False, False, False, True], [True, True, False, False, True, False]]


def test_greedy_tree_walk_takes_the_matching_child_at_each_node():
    #          root -> 0:5 -> 2:7 -> 3:8 ; root -> 1:6 -> 4:9 ; root -> 5:5 (duplicate of node 0)
    parents = torch.tensor([[-1, -1, 0, 2, 1, -1]])
    ids = torch.tensor([[5, 6, 7, 8, 9, 5]])
    _, valid, _ = tree_ancestors(parents, torch.tensor([6]))
    # the target's argmax at each pass index (root, then nodes 0..5)
    n, nxt, path = greedy_tree_accept(ids, parents, valid, torch.tensor([[5, 7, 1, 8, 2, 1, 1]]))
    assert (n.item(), nxt.item(), path[0, :3].tolist()) == (3, 2, [0, 2, 3])
    n, nxt, path = greedy_tree_accept(ids, parents, valid, torch.tensor([[6, 7, 3, 8, 2, 1, 1]]))
    assert (n.item(), nxt.item(), path[0, :1].tolist()) == (1, 3, [1])
    n, nxt, _ = greedy_tree_accept(ids, parents, valid, torch.tensor([[4, 7, 1, 8, 3, 1, 1]]))
    assert (n.item(), nxt.item()) == (0, 4)


def test_first_chain_follows_each_nodes_first_child():
    parents = torch.tensor([[-1, -1, 1, 0, 2]])
    _, valid, _ = tree_ancestors(parents, torch.tensor([5]))
    ids, lengths, _ = first_chain(torch.tensor([[4, 5, 6, 7, 8]]), parents, valid, None)
    assert ids[0, : lengths[0]].tolist() == [4, 7]


@pytest.mark.parametrize("kind", ["sampled", "one-hot", "duplicates"])
def test_multi_draft_rejection_keeps_the_target_law_at_one_node(kind):
    """First token over many runs of a root with 3 children ~ the target (chi-square, ALPHA)."""
    vocab = 6
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    target = torch.stack([p] + [torch.full((vocab,), 1 / vocab, dtype=torch.float64)] * 3)
    parents = torch.tensor([-1, -1, -1])
    trials = 6000
    counts = torch.zeros(vocab)
    for t in range(trials):
        g = torch.Generator().manual_seed(10_000 + t)
        if kind == "one-hot":
            tokens, draft = torch.tensor([0, 3, 1]), None
        elif kind == "duplicates":
            tokens, draft = torch.tensor([2, 2, 4]), None
        else:  # three independent draws from q, which may repeat
            tokens, draft = torch.multinomial(q, 3, replacement=True, generator=g), q.expand(3, vocab)
        path, nxt = tree_rejection_sample(tokens, parents, torch.ones(3, dtype=torch.bool), draft, target, g)
        counts[tokens[path[0]] if path else nxt] += 1
    assert chi_square_pvalue(counts, p) > ALPHA


# -- drafters that return trees ------------------------------------------------------------------


class OracleTreeDrafter(Drafter):
    """Random trees around the target's true greedy continuation (computed with the target
    itself, test-only): branching, duplicate siblings, depth varying by row, the true line hidden
    on a random branch, so the accepted path is often not the first-drafted one."""

    api_version = 2
    tree_budget = 12

    def __init__(self, model, seed: int = 0) -> None:
        super().__init__(None, None)
        self.model, self.rng = model, random.Random(seed)

    def propose(self, ctx, k):
        rows = []
        for tokens in ctx.token_ids:
            depth = self.rng.randint(0, k)
            truth = plain_greedy(self.model, tokens, depth) if depth else []
            nodes: list[tuple[int, int]] = []
            parent = -1
            for level, true_token in enumerate(truth):
                token = true_token if self.rng.random() >= 0.15 else (true_token + 1) % ctx.vocab_size  # may go wrong
                siblings = [self.rng.randrange(ctx.vocab_size) for _ in range(self.rng.randint(0, 2))] + [token]
                if self.rng.random() < 0.3:
                    siblings.append(token)  # a duplicate sibling
                self.rng.shuffle(siblings)
                line = None
                for s in siblings:
                    nodes.append((parent, s))
                    if s == token and line is None:
                        line = len(nodes) - 1
                    if level + 2 <= k and self.rng.random() < 0.3:
                        nodes.append((len(nodes) - 1, self.rng.randrange(ctx.vocab_size)))  # a dead end
                parent = line
            rows.append(nodes)
        return Draft.from_tree_lists(rows, device=ctx.device)


def test_greedy_parity_with_random_trees_in_float64(tiny_model):
    prompts = repetitive_prompts(64)[:3]
    dec = SpeculativeDecoder(tiny_model, None, drafter=OracleTreeDrafter(tiny_model), spec_length=4, adaptive=False,
                             max_batch=3)
    results = dec.generate_ids(prompts, max_new_tokens=24)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(tiny_model, p, 24)
    stats = [r.stats for r in results]
    assert sum(s.accepted_tokens for s in stats) > 10  # the trees were really used
    assert sum(s.drafted_tokens for s in stats) > 2 * sum(s.drafts for s in stats)  # trees, not chains


def test_after_a_tree_round_the_cache_equals_a_fresh_prefill(tiny_model):
    from specdraft.engine.sequence import Sequence

    prompt = repetitive_prompts(64)[0]
    dec = SpeculativeDecoder(tiny_model, None, drafter=OracleTreeDrafter(tiny_model, seed=3), spec_length=4,
                             adaptive=False, max_batch=2)
    engine, runner = dec.engine, dec.engine.runner
    seqs = [Sequence(tokens=list(prompt), settings=GenerationSettings(max_new_tokens=40), max_len=128, seed=0),
            Sequence(tokens=list(prompt[:7]), settings=GenerationSettings(max_new_tokens=40), max_len=128, seed=1)]
    engine.add(seqs)
    for _ in range(6):
        engine.step()
        assert all(s.finish_reason is None for s in seqs)
        for seq in seqs:
            fresh = runner.model.new_cache(1, 256)
            runner.model(torch.tensor([seq.tokens[: seq.cached]]), fresh)
            for i in range(len(fresh.keys)):
                for name, mine, ref in (("keys", runner.cache.kv.keys[i], fresh.keys[i]),
                                        ("values", runner.cache.kv.values[i], fresh.values[i])):
                    torch.testing.assert_close(mine[seq.slot, :, : seq.cached], ref[0, :, : seq.cached],
                                               msg=f"{name} of layer {i}, slot {seq.slot}")
    assert sum(s.stats.accepted_tokens for s in seqs) > 4
    assert any(s.stats.drafted_tokens > s.stats.drafts for s in seqs)
    dec.close()


class SampledTreeDrafter(Drafter):
    """Trees whose children are drawn from a made-up draft distribution (independent draws, so
    siblings may repeat), or deterministic; the target's pipeline is applied to it, as drafters must."""

    api_version = 2
    tree_budget = 7

    def __init__(self, kind: str) -> None:
        super().__init__(None, None)
        self.kind = kind

    def propose(self, ctx, k):
        batch, vocab = ctx.batch_size, ctx.vocab_size
        gen = ctx.generators[0] if ctx.generators else None
        logits = torch.linspace(-1.0, 1.5, vocab, dtype=torch.float64).expand(batch, vocab)
        q = logits_to_probs(logits, ctx.sampling)  # [batch, vocab]
        # root: 3 children; the first child: 2 children; its first: 1 child (depth <= k)
        shape = [-1, -1, -1, 0, 0, 3][: {1: 3, 2: 5}.get(k, 6)]
        n = len(shape)
        if self.kind == "one-hot":
            ids = torch.tensor([[(5 * i + 3) % vocab for i in range(n)]] * batch)
            probs = None
        else:
            ids = torch.multinomial(q.repeat_interleave(n, 0), 1, replacement=True, generator=gen).view(batch, n)
            probs = q[:, None].expand(batch, n, vocab).clone()
        return Draft(token_ids=ids, probs=probs, parents=torch.tensor([shape] * batch))


@pytest.mark.parametrize("kind,params", [
    ("sampled", SamplingParams(temperature=1.0)),
    ("one-hot", SamplingParams(temperature=0.8)),
    ("sampled", SamplingParams(temperature=0.9, top_k=6, top_p=0.9)),
])
def test_sampled_trees_match_the_target_law(small_vocab_model, kind, params):
    """The first K + 1 = 4 emitted tokens ~ the target's exact distribution (chi-square, ALPHA):
    the first round drafts the whole 3-level tree."""
    dec = SpeculativeDecoder(small_vocab_model, None, drafter=SampledTreeDrafter(kind), spec_length=3,
                             adaptive=False, max_batch=512)
    pvalue, results = sampled_joint_pvalue(dec, [3, 5, 3, 5, 3], params, seed=0)
    assert pvalue > ALPHA
    assert sum(r.stats.accepted_tokens for r in results) > len(results) // 10  # the trees were really tested


def test_a_tree_deeper_than_k_is_reported():
    class Deep(Drafter):
        api_version = 2

        def propose(self, ctx, k):
            return Draft.from_tree_lists([[(-1, 1), (0, 2), (1, 3)]] * ctx.batch_size)

    from specdraft.testing import tiny_llama

    dec = SpeculativeDecoder(tiny_llama(), None, drafter=Deep(None, None), spec_length=2, adaptive=False)
    with pytest.raises(DrafterError, match="3 levels deep; at most k = 2"):
        dec.generate_ids([[1, 2, 3]], max_new_tokens=4)


@pytest.mark.parametrize("drafter", ["prompt-lookup", "ngram"])
def test_lookup_drafters_draft_trees_and_conform(tiny_model, drafter):
    from specdraft.testing import check_drafter

    options = {"tree_budget": 8, "tree_width": 3}
    check_drafter(drafter, tiny_model, drafter_options=options, spec_lengths=(3,))
    dec = SpeculativeDecoder(tiny_model, None, drafter=drafter, drafter_options=options, spec_length=3,
                             adaptive=False)
    prompts = repetitive_prompts(64)
    results = dec.generate_ids(prompts, max_new_tokens=30)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(tiny_model, p, 30)
    stats = [r.stats for r in results]
    depth = sum(sum(s.drafted_per_position[:1]) for s in stats)  # rounds that reached depth 1
    levels = sum(sum(s.drafted_per_position) for s in stats)
    assert sum(s.drafted_tokens for s in stats) > levels >= depth > 0  # more nodes than levels: branches
