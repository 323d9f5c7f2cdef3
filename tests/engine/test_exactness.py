"""Exactness in every dtype and under every stage of the sampling pipeline.

Each sampled test drafts K tokens and compares the first K + 1 emitted tokens of many
speculative runs with the target's exact distribution, enumerated in float64 from the model's
own logits (its dtype kept) with transformers' processors (``specdraft.testing.reference``), by
chi-square tests at ``specdraft.testing.SIGNIFICANCE`` with the sample size of the power
calculation in ``specdraft.testing.stats``.
"""

from __future__ import annotations

import pytest
import torch

from specdraft import Draft, Drafter, SamplingParams, SpeculativeDecoder
from specdraft.runner import cpu_ops
from specdraft.sampling import TokenCounts
from specdraft.testing import SIGNIFICANCE as ALPHA
from specdraft.testing import (
    RunnerAsModel,
    TargetDrafter,
    chi_square_pvalue,
    enumerate_plain_sampling,
    exact_joint_distribution,
    naive_penalized_greedy,
    random_heads,
    recorded_proposals,
    repetitive_prompts,
    sampled_joint_pvalue,
    samples_needed,
    samples_pvalue,
    tiny_llama,
)
from specdraft.testing.stats import family_size
from specdraft.verifier import rejection_sample

PROMPT = [3, 5, 3, 5, 3]


class ArgmaxDrafter(Drafter):
    """Drafts the target's own greedy continuation as one-hot (deterministic) drafts: the draft
    whose acceptance probability is the target's top probability itself, where bfloat16
    rounding shows most (0.9975 rounds to 0.9961, 0.999 to 1.0)."""

    def __init__(self, model):
        self.model = model
        super().__init__(None, None)

    def propose(self, ctx, k):
        known: dict[tuple, list[int]] = {}
        rows = []
        for ids in ctx.token_ids:
            if tuple(ids) not in known:
                seq = list(ids)
                with torch.no_grad():
                    for _ in range(k):
                        seq.append(int(self.model(torch.tensor([seq])).logits[0, -1].argmax()))
                known[tuple(ids)] = seq[len(ids):]
            rows.append(known[tuple(ids)])
        return Draft.from_lists(rows)


def _sharp(dtype, vocab=16, scale=8.0):
    model = tiny_llama(vocab_size=vocab, seed=1, dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def saved_draft(tmp_path_factory):
    def _save(dtype, vocab=16):
        draft = tiny_llama(vocab_size=vocab, seed=9, layers=1, dtype=dtype)
        with torch.no_grad():
            draft.lm_head.weight.mul_(6.0)
        path = tmp_path_factory.mktemp(f"draft-{str(dtype).split('.')[-1]}")
        draft.save_pretrained(path)
        return str(path)

    return _save


# -- the pure sampler ---------------------------------------------------------------------------

@pytest.mark.parametrize("one_hot", [True, False])
def test_pure_sampler_with_bfloat16_probabilities(one_hot):
    """bfloat16 rows in, the distribution they describe out. Before the float32 arithmetic the
    one-hot case failed with p = 2e-19 (the acceptance test ran on bfloat16 uniforms)."""
    vocab, n = 16, 400_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 0.5
    logits[0] = 8.0  # top probability 0.9947: bfloat16 keeps 8 bits of it
    target = logits.softmax(-1).to(torch.bfloat16)
    expected = target.double() / target.double().sum()
    g = torch.Generator().manual_seed(1)
    if one_hot:
        drafts, draft_probs = torch.zeros((n, 1), dtype=torch.long), None
    else:
        q = (logits * 0.5).softmax(-1)
        drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
        draft_probs = q.to(torch.bfloat16)[None, None].expand(n, 1, vocab)
    num, nxt = rejection_sample(drafts, torch.ones(n, dtype=torch.long), draft_probs,
                                torch.stack([target, target])[None].expand(n, 2, vocab), g)
    first = torch.where(num > 0, drafts[:, 0], nxt)
    assert chi_square_pvalue(torch.bincount(first, minlength=vocab), expected) > ALPHA


# -- the whole loop in half precision -----------------------------------------------------------

def _traffic(results):
    """(drafted, accepted) tokens over all results."""
    return sum(r.stats.drafted_tokens for r in results), sum(r.stats.accepted_tokens for r in results)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_hot_drafts_of_the_top_token_in_half_precision(dtype):
    """Temperature 0.03 puts 0.9975 on the target's first token. Before the float32 arithmetic,
    bfloat16 accepted its draft with probability 0.9961 and this failed with p = 8e-10. That
    deviation is Cohen's w = 0.028 (0.0014 moved off 0.0025 of mass), so the sample size is
    the power calculation's for w = 0.028 instead of the default 0.1."""
    target = _sharp(dtype)
    params = SamplingParams(temperature=0.03)
    dec = SpeculativeDecoder(target, None, drafter=ArgmaxDrafter(target), spec_length=3, adaptive=False,
                             max_batch=1024)
    n = samples_needed(1, family_size(4), effect=0.028)
    pvalue, results = sampled_joint_pvalue(dec, PROMPT, params, n=n, seed=3)
    assert sum(r.stats.accepted_tokens for r in results) > 0.99 * 3 * len(results)  # the drafts were the top token
    assert pvalue > ALPHA


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_draft_model_sampling_in_half_precision(saved_draft, dtype):
    target = _sharp(dtype)
    dec = SpeculativeDecoder(target, None, drafter="draft-model", spec_length=3, adaptive=False, max_batch=512,
                             drafter_options={"model": saved_draft(dtype), "min_confidence": 0.0})
    pvalue, results = sampled_joint_pvalue(dec, PROMPT, SamplingParams(temperature=1.0), seed=5)
    drafted, accepted = _traffic(results)
    assert drafted >= 3 * len(results) and 0 < accepted < drafted
    assert pvalue > ALPHA


def test_tree_sampling_in_bfloat16(saved_draft):
    """Sampled trees (every drawn child kept, multi-draft rejection) with a bfloat16 target and
    draft: the acceptance arithmetic runs in float32 whatever the model's dtype."""
    target = _sharp(torch.bfloat16)
    dec = SpeculativeDecoder(target, None, drafter="draft-model", spec_length=3, adaptive=False, max_batch=512,
                             drafter_options={"model": saved_draft(torch.bfloat16), "min_confidence": 0.0,
                                              "tree_budget": 6, "tree_width": 2})
    pvalue, results = sampled_joint_pvalue(dec, PROMPT, SamplingParams(temperature=1.0), seed=5)
    drafted, accepted = _traffic(results)
    assert drafted > 2 * sum(r.stats.drafts for r in results)  # trees, not chains
    assert 0 < accepted < drafted
    assert pvalue > ALPHA


@pytest.mark.parametrize("runner", [{"compile": True}, {"quantize": "int8"}, {"quantize": "int4"}],
                         ids=["compiled", "int8", "int4"])
def test_sampling_through_compiled_and_quantized_runners_in_bfloat16(runner):
    """The target is what the runner computes: a quantized model's distribution is its own, so the
    reference enumerates the runner's logits (RunnerAsModel), not transformers' forward."""
    target = _sharp(torch.bfloat16)
    dec = SpeculativeDecoder(target, None, drafter=TargetDrafter(target), spec_length=3, adaptive=False,
                             max_batch=512, **runner)
    assert dec.runner.dtype == torch.bfloat16 and (dec.runner.compiled or dec.runner.quantization)
    params = SamplingParams(temperature=1.0)
    exact = enumerate_plain_sampling(RunnerAsModel(dec.runner.__class__(dec.runner.model), 16), PROMPT, params, 4)
    pvalue, results = sampled_joint_pvalue(dec, PROMPT, params, seed=7, exact=exact)
    drafted, accepted = _traffic(results)
    assert drafted >= 3 * len(results) and 0 < accepted < drafted
    assert pvalue > ALPHA


@pytest.mark.parametrize(("kind", "quantize"), [("eagle", "auto"), ("eagle", "none"), ("mlp-speculator", "auto")])
def test_head_sampling_in_bfloat16(tmp_path, kind, quantize):
    """No filter here: the reference reads transformers' bfloat16 forward and the runner computes
    its own, whose rounding differs, so a top-k boundary can fall between two tokens whose
    logits differ by one bfloat16 step (seen: the 8th and 9th, -0.1807 and -0.1816). The filters
    are tested in float64 above; this test is about the acceptance arithmetic. ``auto``: the
    drafter's products on Q8_0 blocks where the C++ operators load (its distribution is its own,
    the output's must stay the target's), ``none``: on the bfloat16 weights."""
    target = _sharp(torch.bfloat16)
    heads = random_heads(kind, target, tmp_path / kind, seed=3, scale=2.0)
    dec = SpeculativeDecoder(target, None, drafter=kind, spec_length=3, adaptive=False, max_batch=512,
                             drafter_options={"heads": str(heads), "min_confidence": 0.0, "quantize": quantize})
    assert dec.drafter.quantize == (None if quantize == "none" or cpu_ops.load() else "q8_0")
    pvalue, results = sampled_joint_pvalue(dec, PROMPT, SamplingParams(temperature=0.8), seed=6)
    drafted, accepted = _traffic(results)
    assert drafted >= len(results) and 0 < accepted < drafted
    assert pvalue > ALPHA


# -- every stage of the pipeline, at every draft position -----------------------------------------

STAGES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1),
    "repetition": SamplingParams(temperature=1.0, repetition_penalty=1.8),
    "presence": SamplingParams(temperature=1.0, presence_penalty=1.5),
    "frequency": SamplingParams(temperature=1.0, frequency_penalty=-1.2),
    "all": SamplingParams(temperature=0.8, top_k=10, top_p=0.95, min_p=0.05, repetition_penalty=1.4,
                          presence_penalty=0.5, frequency_penalty=0.5),
}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled-drafts", "one-hot-drafts"])
def test_each_pipeline_stage_at_every_draft_position(small_vocab_model, stage, one_hot):
    """Drafts of 3 tokens from the target's own (scaled) distribution, accepted often enough that
    rejection, the residual and the bonus token run at every position; the first 4 tokens are
    compared with an enumeration by transformers' processors (a bug that specdraft's target and
    draft sides share fails here). The penalties read each position's own context."""
    dec = SpeculativeDecoder(small_vocab_model, None, drafter=TargetDrafter(small_vocab_model, one_hot=one_hot),
                             spec_length=3, adaptive=False, max_batch=512)
    pvalue, results = sampled_joint_pvalue(dec, PROMPT, STAGES[stage], seed=11)
    deep = sum(r.stats.acceptance_by_position[1] > 0 for r in results if len(r.stats.acceptance_by_position) > 1)
    assert deep > len(results) / 20  # position 2 was reached and accepted in many runs
    assert pvalue > ALPHA


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_builtin_drafters_with_every_stage_on(small_vocab_model, saved_draft, drafter):
    """The built-ins' own draft paths (deterministic n-gram drafts; a draft model's sampled ones
    with its own penalty counts) with every stage of the pipeline on, 3 tokens deep."""
    options = {"model": saved_draft(torch.float64), "min_confidence": 0.0} if drafter == "draft-model" else None
    dec = SpeculativeDecoder(small_vocab_model, None, drafter=drafter, spec_length=3, adaptive=False, max_batch=512,
                             drafter_options=options)
    pvalue, results = sampled_joint_pvalue(dec, PROMPT, STAGES["all"], seed=11)
    assert _traffic(results)[0] > len(results) / 2  # the drafts were really tested
    assert pvalue > ALPHA


def test_the_penalties_change_the_distribution(small_vocab_model):
    """The stage tests above have power: the target's joint with penalties is not the one without."""
    plain = exact_joint_distribution(small_vocab_model, PROMPT, SamplingParams(temperature=1.0))
    for stage in ("repetition", "presence", "frequency"):
        penalized = exact_joint_distribution(small_vocab_model, PROMPT, STAGES[stage])
        assert (penalized - plain).abs().sum() > 0.05, stage


def test_unseeded_adaptive_sampling_follows_the_target(small_vocab_model, monkeypatch, step_clock):
    """The server's default path: no seed (so the policy measures costs and picks each round's
    draft length) and adaptive drafting. Its randomness is pinned another way: the engine's
    clock is a fixed-step counter and the per-request entropy comes from a seeded generator."""
    import random
    import types

    from specdraft.engine import sequence as sequence_module

    rng = random.Random(2024)
    monkeypatch.setattr(sequence_module, "random", types.SimpleNamespace(SystemRandom=lambda: rng))
    params = STAGES["all"]
    dec = SpeculativeDecoder(small_vocab_model, None, drafter=TargetDrafter(small_vocab_model), spec_length=4,
                             adaptive=True, max_batch=512)
    exact = enumerate_plain_sampling(small_vocab_model, PROMPT, params, 5)
    n = samples_needed(9, family_size(5))
    with recorded_proposals(dec) as proposals:
        results = dec.generate_ids([PROMPT] * n, max_new_tokens=5, **params.model_dump())  # no seed
    assert samples_pvalue([r.token_ids for r in results], exact) > ALPHA
    assert len({k for _, _, k in proposals}) > 1  # the policy chose the draft lengths
    assert any(p.measure_costs for p in dec.engine.policies.values())  # the unseeded path: costs measured


PENALTIES = [
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(presence_penalty=1.0, frequency_penalty=0.7),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5),
]


@pytest.mark.parametrize("params", PENALTIES)
@pytest.mark.parametrize("drafter", ["ngram", "prompt-lookup", "argmax"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_parity_with_penalties(tiny_model, params, drafter, k):
    """Penalties change the argmax too: speculative greedy output equals a naive reference."""
    prompts = repetitive_prompts(64, seed=4)
    d = ArgmaxDrafter(tiny_model) if drafter == "argmax" else drafter
    dec = SpeculativeDecoder(tiny_model, None, drafter=d, spec_length=k, adaptive=False)
    results = dec.generate_ids(prompts, max_new_tokens=16, **params.model_dump())
    for p, r in zip(prompts, results):
        assert r.token_ids == naive_penalized_greedy(tiny_model, p, 16, params)
    assert sum(r.stats.drafted_tokens for r in results) > 0
    if drafter == "argmax":  # the unpenalized argmax: both accepted and rejected drafts
        assert 0 < sum(r.stats.accepted_tokens for r in results) < sum(r.stats.drafted_tokens for r in results)


def test_penalties_change_greedy_output(tiny_model):
    """The parity test above has power: with these penalties greedy output differs from plain."""
    from specdraft.testing import plain_greedy

    prompts = repetitive_prompts(64, seed=4)
    assert any(naive_penalized_greedy(tiny_model, p, 16, params) != plain_greedy(tiny_model, p, 16)
               for p in prompts for params in PENALTIES)


# -- the pipeline's semantics, against transformers' processors and OpenAI's formula --------------

def test_repetition_penalty_and_min_p_match_transformers():
    from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    from specdraft.sampling import penalize, process_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 40, generator=g, dtype=torch.float64) * 3
    context = torch.tensor([[1, 5, 5, 39, 7], [0, 2, 2, 2, 9]])
    params = SamplingParams(temperature=1.0, repetition_penalty=1.7, min_p=0.2)
    counts = TokenCounts.of(context.tolist(), [5, 5], 40)
    ours = penalize(logits, params, counts)
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(context, logits.clone())
    assert torch.equal(ours, theirs)
    kept = process_logits(logits, params, counts) > float("-inf")
    assert torch.equal(kept, MinPLogitsWarper(0.2)(context, theirs.clone()) > float("-inf"))


def test_presence_and_frequency_penalties_follow_openai():
    """``logit -= presence * (count > 0) + frequency * count`` over generated tokens only."""
    from specdraft.sampling import penalize

    logits = torch.zeros(1, 8)
    counts = TokenCounts.of([[4, 4, 1, 1, 1, 2]], [2], 8)  # prompt 4 4; output 1 1 1 2
    out = penalize(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), counts)
    assert out[0].tolist() == [0.0, -1.25, -0.75, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_token_counts_along_a_draft():
    counts = TokenCounts.of([[1, 2, 3]], [2], 6)  # output: 3
    along = counts.along(torch.tensor([[3, 5]]))  # positions: after nothing, after 3, after 3 5
    assert along.in_output[0, :, 3].tolist() == [1.0, 2.0, 2.0]
    assert along.in_output[0, :, 5].tolist() == [0.0, 0.0, 1.0]
    assert along.in_context[0, :, 5].tolist() == [False, False, True]
    assert along.in_context[0, 0].tolist() == [False, True, True, True, False, False]
    assert torch.equal(counts.plus(torch.tensor([[3, 5]])).in_output, along.in_output[:, 2])


def test_probabilities_are_float32_from_half_precision_logits():
    from specdraft.sampling import logits_to_probs

    logits = torch.randn(3, 50).to(torch.bfloat16)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7, top_p=0.9))
    assert probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(3))
