"""The whole verify loop on tiny real models: greedy parity, exact sampling, stops, limits."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from specdraft import Draft, Drafter, SpeculativeDecoder
from specdraft.sampling import SamplingParams, logits_to_probs
from specdraft.testing import SIGNIFICANCE as ALPHA
from specdraft.testing import plain_greedy, repetitive_prompts, sampled_joint_pvalue


class OracleDrafter(Drafter):
    """Proposes the true greedy continuation, corrupted after ``correct`` tokens (-1 = never)."""

    def __init__(self, reference: dict, correct: int = -1):
        super().__init__(None, None)
        self.reference, self.correct = reference, correct

    def propose(self, ctx, k):
        rows = []
        for b, tokens in enumerate(ctx.token_ids):
            prompt = tuple(tokens[: ctx.prompt_lengths[b]])
            done = len(tokens) - len(prompt)
            truth = self.reference[prompt][done : done + k]
            if self.correct >= 0:
                truth = [t if i < self.correct else (t + 1) % ctx.vocab_size for i, t in enumerate(truth)]
            rows.append(truth if ctx.active[b] else [])
        return Draft.from_lists(rows)


class RandomDrafter(Drafter):
    """Draws tokens from random distributions (processed like the target's): a stress test."""

    def propose(self, ctx, k):
        batch = ctx.batch_size
        logits = torch.randn(batch, k, ctx.vocab_size, generator=ctx.generator, dtype=torch.float64) * 2
        probs = logits_to_probs(logits, ctx.sampling)
        if ctx.sampling.greedy:
            return Draft(token_ids=probs.argmax(-1))
        tokens = torch.multinomial(probs.reshape(-1, ctx.vocab_size), 1, generator=ctx.generator).reshape(batch, k)
        return Draft(token_ids=tokens, probs=probs)


def _reference(model, prompts, n):
    return {tuple(p): plain_greedy(model, p, n) for p in prompts}


#: (drafter, k, adaptive): "none" drafts nothing whatever k and adaptive are, so it runs once
PARITY_RUNS = [(d, k, a) for d in ("ngram", "prompt-lookup") for k in (1, 3, 5) for a in (True, False)]
PARITY_RUNS.append(("none", 3, True))


@pytest.mark.parametrize("drafter,k,adaptive", PARITY_RUNS)
def test_greedy_parity_builtin_drafters(tiny_model, drafter, k, adaptive):
    prompts = repetitive_prompts(64)
    expected = _reference(tiny_model, prompts, 40)
    dec = SpeculativeDecoder(tiny_model, None, drafter=drafter, spec_length=k, adaptive=adaptive)
    batched = dec.generate_ids(prompts, max_new_tokens=40)
    for p, r in zip(prompts, batched):
        assert r.token_ids == expected[tuple(p)]
    for p in prompts:  # one at a time too (uniform cache writes instead of scattered ones)
        assert dec.generate_ids([p], max_new_tokens=40)[0].token_ids == expected[tuple(p)]


@pytest.mark.parametrize("correct", [-1, 0, 1, 2])
def test_greedy_parity_with_oracle_drafts(tiny_model, correct):
    """Full acceptance (bonus path) and rejection at every position (rollback path)."""
    prompts = repetitive_prompts(64, seed=3)
    reference = _reference(tiny_model, prompts, 30)
    dec = SpeculativeDecoder(tiny_model, None, drafter=OracleDrafter(reference, correct), spec_length=3, adaptive=False)
    results = dec.generate_ids(prompts, max_new_tokens=30)
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
        if correct == -1:  # every round accepts K and emits K+1
            assert r.stats.acceptance_rate == 1.0
            assert r.stats.target_passes == -(-30 // 4)
        else:
            assert r.stats.accepted_tokens == correct * r.stats.target_passes or r.stats.new_tokens < 4


def test_greedy_parity_random_drafter(tiny_model):
    prompts = repetitive_prompts(64, seed=5)
    reference = _reference(tiny_model, prompts, 25)
    dec = SpeculativeDecoder(tiny_model, None, drafter=RandomDrafter(None, None), spec_length=4)
    for p, r in zip(prompts, dec.generate_ids(prompts, max_new_tokens=25, seed=0)):
        assert r.token_ids == reference[tuple(p)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.7),
])
@pytest.mark.parametrize("drafter", ["random", "ngram"])
def test_sampling_matches_target_joint_distribution(small_vocab_model, params, drafter):
    """Speculative sampling's first K + 1 tokens ~ the target's exact distribution (chi-square,
    ALPHA), with the drafts K = 3 deep; the sizes come from the power calculation."""
    d = RandomDrafter(None, None) if drafter == "random" else drafter
    dec = SpeculativeDecoder(small_vocab_model, None, drafter=d, spec_length=3, max_batch=512)
    pvalue, results = sampled_joint_pvalue(dec, [3, 5, 3, 5, 3], params, seed=1234)
    assert sum(r.stats.drafted_tokens for r in results) > len(results) / 2  # the drafts were really tested
    assert pvalue > ALPHA


def test_seeded_sampling_is_reproducible(tiny_model):
    dec = SpeculativeDecoder(tiny_model, None, drafter="ngram", spec_length=3)
    prompts = repetitive_prompts(64)
    a = dec.generate_ids(prompts, max_new_tokens=20, temperature=1.0, seed=7)
    b = dec.generate_ids(prompts, max_new_tokens=20, temperature=1.0, seed=7)
    c = dec.generate_ids(prompts, max_new_tokens=20, temperature=1.0, seed=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_eos_inside_accepted_draft_stops_and_discards_the_rest(tiny_model):
    prompt = repetitive_prompts(64)[0]
    reference = plain_greedy(tiny_model, prompt, 30)
    eos = reference[7]
    cut = reference.index(eos) + 1
    dec = SpeculativeDecoder(tiny_model, None, drafter=OracleDrafter({tuple(prompt): reference}), spec_length=4)
    dec.target = dec.engine.target = type(dec.target)(**{**dec.target.__dict__, "eos_token_ids": (eos,)})
    r = dec.generate_ids([prompt], max_new_tokens=30)[0]
    assert r.token_ids == reference[:cut] and r.finish_reason == "eos"


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_new_tokens_is_exact(tiny_model, n):
    prompt = repetitive_prompts(64)[0]
    reference = plain_greedy(tiny_model, prompt, n)
    dec = SpeculativeDecoder(tiny_model, None, drafter=OracleDrafter({tuple(prompt): reference + [0] * 8}), spec_length=5)
    r = dec.generate_ids([prompt], max_new_tokens=n)[0]
    assert r.token_ids == reference and r.finish_reason == "length"
    assert r.stats.drafted_tokens <= max(n - 1, 0) * r.stats.target_passes  # never drafts past the budget


def test_spec_length_shrinks_at_the_context_limit():
    from specdraft.testing import tiny_llama

    model = tiny_llama(vocab_size=64, seed=2, max_positions=40)
    prompt = repetitive_prompts(64)[0] * 2  # 34 tokens, 6 positions left
    reference = plain_greedy(model, prompt, 6)
    dec = SpeculativeDecoder(model, None, drafter="prompt-lookup", spec_length=5)
    r = dec.generate_ids([prompt], max_new_tokens=50)[0]
    assert r.token_ids == reference and len(prompt) + len(r.token_ids) == 40
    assert r.finish_reason == "length"


def test_empty_draft_is_a_plain_one_token_step(tiny_model):
    widths = []
    dec = SpeculativeDecoder(tiny_model, None, drafter="none", spec_length=4)
    assert dec.runner_info == {"implementation": "specdraft", "compiled": False, "quantization": None,
                               "dtype": "float64", "kernels": {"packed": 0}, "dtype_reason": "the loaded model's own"}
    forward = dec.runner.forward
    dec.runner.forward = lambda tokens, **kw: widths.append(tokens.shape[1]) or forward(tokens, **kw)
    r = dec.generate_ids([[1, 2, 3]], max_new_tokens=5)[0]
    assert widths == [2, 1, 1, 1, 1, 1]  # prefill of the prompt minus its last token, then 1 per round
    assert r.stats.target_passes == 5 and r.stats.drafted_tokens == 0


def test_a_drafter_that_never_drafts_is_not_asked(tiny_model):
    """``none`` (``never_drafts``): every round is a plain step planned without asking the drafter
    (an ask and its empty proposal were about 2% of a step); its other hooks still run."""
    heard = []

    class Never(Drafter):
        never_drafts = True

        def propose(self, ctx, k):
            raise AssertionError("asked to propose")

        def on_verified(self, ctx, num_accepted):
            heard.append(list(num_accepted))

    prompt = repetitive_prompts(64)[0]
    dec = SpeculativeDecoder(tiny_model, None, drafter=Never(None, None), spec_length=4)
    r = dec.generate_ids([prompt], max_new_tokens=6)[0]
    assert r.token_ids == plain_greedy(tiny_model, prompt, 6)
    assert heard == [[0]] * 6 and r.stats.target_passes == 6 and dec.engine.policies == {}


def test_stats_count_positions(tiny_model):
    prompt = repetitive_prompts(64)[0]
    reference = plain_greedy(tiny_model, prompt, 12)
    dec = SpeculativeDecoder(tiny_model, None, drafter=OracleDrafter({tuple(prompt): reference}, correct=2), spec_length=3,
                             adaptive=False)
    s = dec.generate_ids([prompt], max_new_tokens=12)[0].stats
    assert s.acceptance_by_position[:3] == [1.0, 1.0, 0.0]
    assert s.tokens_per_pass == s.new_tokens / s.target_passes == 3.0
    # 4 rounds drafting 3 and accepting 2, the last one's draft cut to 2 by the 12-token budget
    assert (s.prompt_tokens, s.new_tokens, s.target_passes, s.drafts) == (len(prompt), 12, 4, 4)
    assert (s.drafted_tokens, s.accepted_tokens) == (3 + 3 + 3 + 2, 2 + 2 + 2 + 2)
    assert s.drafted_per_position[:3] == [4, 4, 3] and s.accepted_per_position[:3] == [4, 4, 0]
    # each part was timed, and they are disjoint stretches of the request's life on one monotonic
    # clock: together no longer than its total (a part counted twice, or per row, breaks this)
    assert s.prefill_time_s > 0 and s.draft_time_s > 0 and s.verify_time_s > 0
    assert s.prefill_time_s + s.draft_time_s + s.verify_time_s <= s.total_time_s


def test_drafting_time_is_the_drafters_calls_not_the_engines_bookkeeping(tiny_model, step_clock, monkeypatch):
    """A round's drafting time is its proposal and the drafter's calls after the verify pass;
    the engine's own bookkeeping (planning the round, committing the tokens, the policy, the
    reports), which plain decoding pays as well, is "other"."""
    from specdraft.engine import engine

    prompt = repetitive_prompts(64)[0]
    reference = plain_greedy(tiny_model, prompt, 12)

    class Timed(OracleDrafter):
        def propose(self, ctx, k):
            step_clock.now += 1.0
            return super().propose(ctx, k)

        def on_verified(self, ctx, accepted):
            step_clock.now += 0.5

    commit = engine.Engine._commit

    def slow_commit(self, *args):
        step_clock.now += 100.0
        return commit(self, *args)

    plan = engine.Engine._plan

    def slow_plan(self, *args):
        step_clock.now += 100.0
        return plan(self, *args)

    monkeypatch.setattr(engine.Engine, "_commit", slow_commit)
    monkeypatch.setattr(engine.Engine, "_plan", slow_plan)
    dec = SpeculativeDecoder(tiny_model, None, drafter=Timed({tuple(prompt): reference}, correct=2), spec_length=3,
                             adaptive=False)
    s = dec.generate_ids([prompt], max_new_tokens=12)[0].stats
    assert s.target_passes == 4
    # 1.5 s of the drafter's own per round, and a few 1 ms clock readings; none of the 100 s plans and commits
    assert 4 * 1.5 <= s.draft_time_s < 4 * 1.5 + 0.1


def test_adaptive_verifier_stops_verifying_hopeless_drafts(tiny_model, step_clock):
    """A drafter that is always wrong: the adaptive loop soon stops paying verify width for it,
    even with wide passes costing no more than one-token ones (the clock is a fixed step)."""
    prompt = repetitive_prompts(64)[1]
    reference = plain_greedy(tiny_model, prompt, 60)
    wrong = OracleDrafter({tuple(prompt): reference}, correct=0)
    fixed = SpeculativeDecoder(tiny_model, None, drafter=wrong, spec_length=4, adaptive=False)
    adaptive = SpeculativeDecoder(tiny_model, None, drafter=wrong, spec_length=4)
    f, a = fixed.generate_ids([prompt], max_new_tokens=60)[0], adaptive.generate_ids([prompt], max_new_tokens=60)[0]
    assert f.token_ids == a.token_ids == reference
    assert a.stats.drafted_tokens < f.stats.drafted_tokens / 3


def test_seeded_sampling_with_adaptive_length_ignores_timings(tiny_model):
    dec = SpeculativeDecoder(tiny_model, None, drafter="prompt-lookup", spec_length=4)
    absurd = {1: 1.0, 2: 50.0, 3: 50.0, 4: 50.0, 5: 50.0}  # absurd costs must not matter
    dec.engine.policy(4).seconds = {w: deque([t] * 5, maxlen=5) for w, t in absurd.items()}
    a = dec.generate_ids(repetitive_prompts(64), max_new_tokens=20, temperature=1.0, seed=3)
    dec.engine.policy(4).seconds = {}
    b = dec.generate_ids(repetitive_prompts(64), max_new_tokens=20, temperature=1.0, seed=3)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


class _ScriptedPolicy:
    """Chooses draft lengths from a script and records what the verifier reports back."""

    def __init__(self, script):
        self.script, self.observed, self.measure_costs = deque(script), [], True

    def reset_acceptance(self):
        pass

    def choose(self, cap=None):
        return self.script.popleft() if self.script else 0

    def observe(self, width, seconds, drafted, accepted, draft_seconds=None):
        self.observed.append((width, draft_seconds))


def test_drafting_time_is_a_cost_sample_only_after_a_drafting_round(tiny_model):
    """The first drafting round (a draft model's prefill) and one after plain steps (its catch-up
    on the tokens they emitted) are not samples of what drafting a token costs: counting them
    made a paused draft model look ever dearer until the policy never drafted again."""
    prompt = repetitive_prompts(64)[0]
    dec = SpeculativeDecoder(tiny_model, None, drafter="prompt-lookup", spec_length=2)
    ks = [2, 2, 0, 0, 1, 2, 0, 2, 2]
    policy = _ScriptedPolicy(ks)
    dec.engine.policies[1] = policy
    r = dec.generate_ids([prompt], max_new_tokens=40)[0]
    assert r.token_ids == plain_greedy(tiny_model, prompt, 40)
    measured = [d is not None for _, d in policy.observed[: len(ks)]]
    assert measured == [False, True, False, False, False, True, False, False, True]
