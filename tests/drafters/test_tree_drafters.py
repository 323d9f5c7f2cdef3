"""Tree drafting in ``medusa`` (top-k per head, pruned to the budget) and ``draft-model`` (EAGLE-2's
dynamic tree over the draft model's own cache): greedy parity in float64 with batched rows of
different lengths, sampled trees against the target's exact law (chi-square at ALPHA), the
conformance suite. The draft's cache after tree rounds: tests/drafters/test_draft_model.py.

eagle's trees: tests/drafters/test_eagle_tree.py (and its sampled trees here).
"""

from __future__ import annotations

import pytest
import torch

from specdraft import SamplingParams, SpeculativeDecoder
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
    own = {"model": source, "dtype": "float64"} if kind == "draft-model" else {"heads": source}
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
    check_drafter(kind, tiny_model, drafter_options=_options(kind, source), spec_lengths=(3,))


@pytest.mark.parametrize("kind,params", [
    ("eagle", SamplingParams(temperature=1.0)),
    ("eagle-gated", SamplingParams(temperature=1.0)),
    ("medusa", SamplingParams(temperature=0.9, top_k=6, repetition_penalty=1.3)),
    ("draft-model", SamplingParams(temperature=0.9, top_p=0.9, presence_penalty=0.5)),
])
def test_sampled_trees_match_the_target_law(small_vocab_model, tmp_path, kind, params):
    """The first K + 1 = 4 emitted tokens ~ the target's exact distribution (chi-square, ALPHA, the
    power calculation's sample size), with every drawn child kept and verified by multi-draft
    rejection; eagle with and without a copy gate."""
    if kind.startswith("eagle"):
        source = str(random_heads("eagle", small_vocab_model, tmp_path, scale=0.05, copy_gate=kind == "eagle-gated"))
        kind = "eagle"
    elif kind == "medusa":
        source = str(random_heads("medusa", small_vocab_model, tmp_path, scale=0.05))
    else:
        draft = tiny_llama(vocab_size=16, seed=9, layers=1)
        with torch.no_grad():
            draft.lm_head.weight.mul_(6.0)
        draft.save_pretrained(tmp_path)
        source = str(tmp_path)
    options = {**_options(kind, source), "tree_budget": 6}
    dec = SpeculativeDecoder(small_vocab_model, None, drafter=kind, spec_length=3, adaptive=False, max_batch=512,
                             drafter_options=options)
    pvalue, results = sampled_joint_pvalue(dec, [3, 5, 3, 5, 3], params, seed=0)
    assert pvalue > ALPHA
    assert sum(r.stats.drafted_tokens for r in results) > 2 * sum(r.stats.drafts for r in results)  # trees
    assert sum(r.stats.accepted_tokens for r in results) > len(results) // 10


def test_a_one_token_prompt_drafts_an_empty_sampled_tree(tiny_model, medusa_heads):
    """Heads have no hidden state to draft from before a one-token prompt's first round: the tree
    is empty in every row, which was a StopIteration building its (empty) probability table."""
    dec = SpeculativeDecoder(tiny_model, None, drafter="medusa", spec_length=4, adaptive=False,
                             drafter_options=_options("medusa", medusa_heads))
    [result] = dec.generate_ids([[7]], max_new_tokens=6, temperature=1.0, seed=0)
    assert len(result.token_ids) == 6
    dec.close()
