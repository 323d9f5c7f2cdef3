"""Tree drafting in ``medusa`` (top-k per head, pruned to the budget) and ``draft-model`` (EAGLE-2's
dynamic tree over the draft model's own cache): greedy parity in float64 with batched rows of
different lengths, sampled trees against the target's exact law (chi-square at ALPHA), the
conformance suite, and the draft's cache after tree rounds.

eagle's trees: tests/drafters/test_eagle_tree.py and tests/engine/test_tree.py.
"""

from __future__ import annotations

import pytest
import torch

from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.runner import load_runner
from specdraft.testing import SIGNIFICANCE as ALPHA
from specdraft.testing import check_drafter, plain_greedy, random_heads, repetitive_prompts, sampled_joint_pvalue, tiny_llama

TREE = {"min_confidence": 0.0, "tree_budget": 8, "tree_width": 2}


@pytest.fixture(scope="module")
def medusa_heads(tiny_model, tmp_path_factory):
    return str(random_heads("medusa", tiny_model, tmp_path_factory.mktemp("medusa-tree"), scale=0.02))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tree-draft")
    tiny_llama(vocab_size=64, seed=7, layers=1).save_pretrained(path)
    return str(path)


def _options(kind: str, source: str, **extra) -> dict:
    own = {"heads": source} if kind == "medusa" else {"model": source, "dtype": "float64"}
    return {**own, **TREE, **extra}


@pytest.mark.parametrize("kind", ["medusa", "draft-model"])
def test_batched_greedy_trees_equal_plain_greedy(tiny_model, medusa_heads, draft_dir, kind):
    prompts = repetitive_prompts(64)[:3]
    prompts[1] = prompts[1][:6]  # rows of different lengths share the tree passes
    source = medusa_heads if kind == "medusa" else draft_dir
    dec = SpeculativeDecoder(tiny_model, None, drafter=kind, spec_length=4, adaptive=False, max_batch=3,
                             drafter_options=_options(kind, source))
    shapes = []  # per round: (nodes, depth) of the widest row
    inner = dec.drafter.propose

    def spy(ctx, k):
        draft = inner(ctx, k)
        assert ctx.tree_budget == TREE["tree_budget"]
        shapes.append((int(draft.token_ids.shape[1]), k))
        return draft

    dec.drafter.propose = spy
    results = dec.generate_ids(prompts, max_new_tokens=20)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(tiny_model, p, 20)
    assert sum(nodes > k for nodes, k in shapes) > len(shapes) // 2  # wider than deep: really trees
    assert all(nodes <= TREE["tree_budget"] for nodes, _ in shapes)
    stats = [r.stats for r in results]
    assert sum(s.accepted_tokens for s in stats) > 0  # rolled back after partial acceptance


@pytest.mark.parametrize("kind", ["medusa", "draft-model"])
def test_conforms_with_trees(tiny_model, medusa_heads, draft_dir, kind):
    source = medusa_heads if kind == "medusa" else draft_dir
    check_drafter(kind, tiny_model, drafter_options=_options(kind, source), spec_lengths=(3,), samples=2000)


def test_draft_cache_after_tree_rounds_equals_a_fresh_prefill(tiny_model, draft_dir):
    """The tree's nodes sit past the fed tokens and are rolled back; what the cache keeps is a
    fresh prefill of the accepted sequence."""
    dec = SpeculativeDecoder(tiny_model, None, drafter="draft-model", spec_length=4, adaptive=False,
                             drafter_options=_options("draft-model", draft_dir))
    prompt = repetitive_prompts(64)[0]
    drafter = dec.drafter
    seen, leave = {}, drafter.on_leave

    def on_leave(seq_id):  # the sequence's state as it leaves (then it is dropped)
        seen["fed"] = list(drafter._fed[seq_id])
        seen["length"] = int(drafter.runner.lengths[drafter._slots.slot[seq_id]])
        leave(seq_id)

    drafter.on_leave = on_leave
    result = dec.generate_ids([prompt], max_new_tokens=21)[0]
    fed = seen["fed"]
    assert result.stats.drafted_tokens > result.stats.drafts * 4  # trees: more nodes than levels
    assert len(fed) > len(prompt) + 4 and fed == (prompt + result.token_ids)[: len(fed)]
    assert seen["length"] >= len(fed)  # the last tree's nodes, if any, lie past the fed tokens
    fresh = load_runner(drafter.model)
    fresh.reset(1, len(fed))
    fresh.forward(torch.tensor([fed]))
    ours, ref = drafter.runner.cache, fresh.cache
    for mine, theirs in zip(ours.keys + ours.values, ref.keys + ref.values):
        assert torch.allclose(mine[:, :, : len(fed)], theirs[:, :, : len(fed)], atol=1e-10)


@pytest.mark.parametrize("kind,params", [
    ("medusa", SamplingParams(temperature=1.0)),
    ("medusa", SamplingParams(temperature=0.9, top_k=6, repetition_penalty=1.3)),
    ("draft-model", SamplingParams(temperature=1.0)),
    ("draft-model", SamplingParams(temperature=0.9, top_p=0.9, presence_penalty=0.5)),
])
def test_sampled_trees_match_the_target_law(small_vocab_model, tmp_path, kind, params):
    """The first two emitted tokens ~ the target's exact joint (chi-square, ALPHA), with every
    drawn child kept and verified by multi-draft rejection."""
    if kind == "medusa":
        source = str(random_heads("medusa", small_vocab_model, tmp_path, scale=0.05))
    else:
        draft = tiny_llama(vocab_size=16, seed=9, layers=1)
        with torch.no_grad():
            draft.lm_head.weight.mul_(6.0)
        draft.save_pretrained(tmp_path)
        source = str(tmp_path)
    options = {**_options(kind, source), "tree_budget": 6}
    dec = SpeculativeDecoder(small_vocab_model, None, drafter=kind, spec_length=3, adaptive=False, max_batch=64,
                             drafter_options=options)
    pvalue, results = sampled_joint_pvalue(dec, [3, 5, 3, 5, 3], params, n=4000, seed=0, max_new_tokens=3)
    assert pvalue > ALPHA
    assert sum(r.stats.drafted_tokens for r in results) > 2 * sum(r.stats.drafts for r in results)  # trees
    assert sum(r.stats.accepted_tokens for r in results) > len(results) // 10
