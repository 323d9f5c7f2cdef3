"""eagle3: the target's states at three layers reach the drafter, and its drafts (chains and
trees, over a draft vocabulary smaller than the target's) leave the output exactly the target's.

Published layouts: test_published_heads.py; training: test_heads.py (parametrized over the kinds).
"""

from __future__ import annotations

import pytest
import torch

from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.drafters.heads import Eagle3Drafter
from specdraft.testing import (SIGNIFICANCE, plain_greedy, random_heads, repetitive_prompts, sampled_joint_pvalue,
                               tiny_llama)

#: a draft vocabulary of 40 of the target's 64 tokens, not a prefix of it
DRAFT_VOCAB = torch.cat([torch.arange(0, 48, 2), torch.arange(48, 64)])


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=8, seed=4)  # aux layers (2, 4, 5)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    return str(random_heads("eagle3", target, tmp_path_factory.mktemp("eagle3"), seed=2, head_ids=DRAFT_VOCAB,
                            scale=1.5))


def test_the_drafter_gets_the_states_of_its_layers_from_the_verify_passes(target, heads, monkeypatch):
    """What ``on_hidden_states`` receives, position by position over prefill and every verify pass,
    is transformers' ``output_hidden_states`` at the heads' three layers, side by side."""
    seen: dict[int, list[torch.Tensor]] = {}
    original = Eagle3Drafter.on_hidden_states

    def record(self, ctx, hidden_states):
        for b, h in enumerate(hidden_states):
            seen.setdefault(b, []).append(h.clone())
        return original(self, ctx, hidden_states)

    monkeypatch.setattr(Eagle3Drafter, "on_hidden_states", record)
    dec = SpeculativeDecoder(target, None, drafter="eagle3", spec_length=3, adaptive=False,
                             drafter_options={"heads": heads, "min_confidence": 0.0})
    assert dec.engine.drafter.hidden_layers == (2, 4, 5)
    prompts = [[5, 9, 13, 9, 5, 9, 13], [7, 7, 21]]
    results = dec.generate_ids(prompts, max_new_tokens=12)
    for b, (prompt, result) in enumerate(zip(prompts, results)):
        states = torch.cat(seen[b])  # [n, 3 * 32]: every position whose next token is known
        sequence = torch.tensor([prompt + result.token_ids])
        with torch.no_grad():
            ref = target(sequence, output_hidden_states=True).hidden_states
        expected = torch.cat([ref[i][0] for i in (2, 4, 5)], -1)[: states.shape[0]]
        assert states.shape[0] >= len(prompt) + len(result.token_ids) - 2
        torch.testing.assert_close(states, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("tree_budget", [1, 8], ids=["chain", "tree"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_parity_on_ragged_batches(target, heads, k, tree_budget):
    prompts = repetitive_prompts(64, seed=3)  # different lengths, batched together
    dec = SpeculativeDecoder(target, None, drafter="eagle3", spec_length=k, adaptive=False,
                             drafter_options={"heads": heads, "min_confidence": 0.0, "tree_budget": tree_budget})
    results = dec.generate_ids(prompts, max_new_tokens=24)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(target, p, 24)
    drafted = sum(r.stats.drafted_tokens for r in results)
    assert drafted >= len(prompts) * k  # it drafted every round it could


def test_tokens_outside_the_draft_vocabulary_are_never_drafted(target, heads):
    dec = SpeculativeDecoder(target, None, drafter="eagle3", spec_length=4, adaptive=False,
                             drafter_options={"heads": heads, "min_confidence": 0.0})
    drafter = dec.engine.drafter
    proposals = []
    original = drafter.propose

    def spy(ctx, k):
        draft = original(ctx, k)
        proposals.append(draft)
        return draft

    drafter.propose = spy
    dec.generate_ids(repetitive_prompts(64, seed=4), max_new_tokens=16, temperature=1.0, seed=3)
    allowed = set(DRAFT_VOCAB.tolist())
    drafted = [t for d in proposals if d.token_ids.numel()
               for row, n in zip(d.token_ids.tolist(), (d.lengths if d.lengths is not None
                                                        else torch.full((len(d.token_ids),), d.token_ids.shape[1])).tolist())
               for t in row[:n]]
    assert drafted and set(drafted) <= allowed
    probs = [d.probs for d in proposals if d.probs is not None]
    assert probs and all(float(p[..., sorted(set(range(64)) - allowed)].abs().max()) == 0 for p in probs)


@pytest.mark.parametrize("tree_budget", [1, 6], ids=["chain", "tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_matches_the_target_distribution(tmp_path, dtype, tree_budget):
    """The first K + 1 = 4 sampled tokens against the target's enumerated distribution (chi-square
    at SIGNIFICANCE), drafts 3 deep from a draft vocabulary of 12 of the 16 tokens. bfloat16: no
    filter, as in test_exactness.py's head test (the reference's rounding differs from the runner's)."""
    target = tiny_llama(vocab_size=16, seed=1, layers=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    target = target.to(dtype)
    heads = random_heads("eagle3", target, tmp_path, seed=5, head_ids=torch.arange(2, 14), scale=2.0)
    dec = SpeculativeDecoder(target, None, drafter="eagle3", spec_length=3, adaptive=False, max_batch=512,
                             drafter_options={"heads": str(heads), "min_confidence": 0.0, "tree_budget": tree_budget})
    params = SamplingParams(temperature=0.9, top_k=8) if dtype == torch.float32 else SamplingParams(temperature=0.8)
    pvalue, results = sampled_joint_pvalue(dec, [3, 5, 3, 5, 3], params, seed=11)
    drafted = sum(r.stats.drafted_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert drafted >= len(results) and 0 < accepted < drafted  # traffic on both paths
    assert pvalue > SIGNIFICANCE
