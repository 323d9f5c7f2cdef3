"""Log-probabilities (``logprobs=N``, ``logprobs_mode``) under speculation are plain decoding's.

Greedy: the same target decoded plainly (the ``none`` drafter) reports the same numbers at every
position, the output token's and the top N: bit for bit in float32 (the runner's passes are row-
and width-invariant there), to 1e-12 in float64 (the float64 runner is not: a wide pass's logits
may differ from a one-token step's in the last bit). Chains (a drafter of the target's own
choices, ngram) and trees whose accepted path leaves the first-drafted line, penalties and
``min_tokens`` on. Sampled (seeded) and greedy: every reported number equals a recomputation
from one forward of the final sequence through transformers' own model and processors
(``specdraft.testing.reference``: no specdraft code) at that position.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.errors import ConfigError
from specdraft.testing import TargetDrafter, repetitive_prompts, tiny_llama
from specdraft.testing.drafters import TopTwoTree
from specdraft.testing.reference import reference_probs

N = 12  # tokens per output
TOP = 5
PROMPTS = repetitive_prompts(64)[:2]
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)


@functools.lru_cache(maxsize=None)
def _model(dtype):
    return tiny_llama(vocab_size=64, seed=0, dtype=dtype)


def _decoder(model, drafter: str, rows: int, scale: float = 1.0) -> SpeculativeDecoder:
    made = {"target": lambda: TargetDrafter(model, scale=scale), "tree": lambda: TopTwoTree(model)}
    return SpeculativeDecoder(model, None, drafter=made[drafter]() if drafter in made else drafter, spec_length=4,
                              adaptive=False, max_batch=rows)


def _generate(model, drafter, prompts=PROMPTS, **settings):
    with _decoder(model, drafter, len(prompts)) as dec:
        return dec.generate_ids(prompts, max_new_tokens=N, **settings)


@functools.lru_cache(maxsize=None)
def _plain(dtype, mode: str, penalized: bool, prompts=tuple(map(tuple, PROMPTS))):
    return _generate(_model(dtype), "none", [list(p) for p in prompts], logprobs=TOP, logprobs_mode=mode,
                     **(PENALTIES if penalized else {}))


def _assert_same(got, want, dtype):
    """``got`` and ``want`` (TokenLogprob lists) agree: bits in float32, 1e-12 in float64."""
    assert [e.token_id for e in got] == [e.token_id for e in want]
    for g, w in zip(got, want):
        if dtype == torch.float32:
            assert g == w
        else:
            assert g.logprob == pytest.approx(w.logprob, abs=1e-12)
            assert [i for i, _ in g.top] == [i for i, _ in w.top]
            assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-12)


@pytest.mark.parametrize("dtype, drafter, mode, penalized", [
    (torch.float32, "target", "processed", True),
    (torch.float32, "tree", "processed", True),
    (torch.float32, "ngram", "raw", False),
    (torch.float32, "tree", "raw", False),
    (torch.float64, "target", "processed", True),
    (torch.float64, "tree", "raw", False),
], ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, bool) else ("penalties" if v else "plain"))
def test_greedy_logprobs_equal_plain_decodings(dtype, drafter, mode, penalized):
    model = _model(dtype)
    plain = _plain(dtype, mode, penalized)
    spec = _generate(model, drafter, logprobs=TOP, logprobs_mode=mode, **(PENALTIES if penalized else {}))
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids and len(s.logprobs) == len(s.token_ids) == N
        _assert_same(s.logprobs, p.logprobs, dtype)
        for e in s.logprobs:
            assert len(e.top) == TOP and e.top[0][1] == e.logprob  # greedy: the token is the most likely
    # drafts were kept (the target's own choices nearly always; ngram's now and then): wide passes
    assert sum(r.stats.accepted_tokens for r in spec) >= (1 if drafter == "ngram" else N)


def test_min_tokens_mask_is_in_processed_logprobs_not_in_raw():
    """EOS is the target's own choice at output position 2; ``min_tokens=5`` holds it back there: the
    processed distribution has it at -inf (not among the top tokens), the raw one first."""
    model, prompt = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32), PROMPTS[:1]
    eos = _plain(torch.float32, "raw", False)[0].token_ids[2]
    model.config.eos_token_id = eos
    for mode in ("processed", "raw"):
        plain = _generate(model, "none", prompts=prompt, min_tokens=5, logprobs=TOP, logprobs_mode=mode)[0]
        spec = _generate(model, "target", prompts=prompt, min_tokens=5, logprobs=TOP, logprobs_mode=mode)[0]
        assert spec.token_ids == plain.token_ids and spec.token_ids[2] != eos
        _assert_same(spec.logprobs, plain.logprobs, torch.float32)
        top = [i for i, _ in spec.logprobs[2].top]
        assert (top[0] == eos) if mode == "raw" else (eos not in top)


def test_logprobs_are_cut_with_the_tokens_at_a_stop():
    """A stop token in the middle of an accepted burst: the tokens after it go, and their logprobs."""
    model = _model(torch.float32)
    full = _plain(torch.float32, "processed", True)[0]
    stop = full.token_ids[7]
    first = full.token_ids.index(stop)
    spec = _generate(model, "target", prompts=PROMPTS[:1], logprobs=TOP, stop_token_ids=[stop], **PENALTIES)[0]
    assert spec.finish_reason == "stop" and spec.token_ids == full.token_ids[: first + 1]
    _assert_same(spec.logprobs, full.logprobs[: first + 1], torch.float32)


def test_stream_chunks_carry_their_tokens_logprobs_and_others_cost_nothing():
    """Streamed: each chunk's logprobs are its token ids', they add up to the result's (plain
    decoding's); a request sharing the batch without asking gets None."""
    model = _model(torch.float32)
    with _decoder(model, "target", 2) as dec:
        asking = dec.stream_ids(PROMPTS[0], max_new_tokens=N, logprobs=TOP, **PENALTIES)
        silent = dec.stream_ids(PROMPTS[1], max_new_tokens=N, **PENALTIES)
        chunks = list(asking)
        assert all(c.token_ids == [e.token_id for e in c.logprobs] for c in chunks)
        assert [e for c in chunks for e in c.logprobs] == asking.result.logprobs
        assert any(len(c.token_ids) > 1 for c in chunks)  # bursts of several tokens
        assert all(c.logprobs is None for c in silent) and silent.result.logprobs is None
    _assert_same(asking.result.logprobs, _plain(torch.float32, "processed", True)[0].logprobs, torch.float32)


def _close(a: float, b: float) -> bool:
    # the reference's presence term is float32 (``0.4 * bool_tensor``), about 1e-9 off in float64
    return a == b or abs(a - b) <= 1e-7


def _check_against_reference(hf_model, prompt, result, params: SamplingParams, mode: str):
    """Every reported number against one forward of prompt + output through ``hf_model`` and
    transformers' processors (greedy: the penalized logits at temperature 1, no filters)."""
    sequence = list(prompt) + result.token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([sequence])).logits[0].double()  # [len, vocab]
    if params.greedy:
        params = params.model_copy(update={"temperature": 1.0})
    for i, entry in enumerate(result.logprobs):
        at = len(prompt) - 1 + i
        if mode == "raw":
            expected = logits[at].log_softmax(-1)
        else:
            expected = reference_probs(logits[at : at + 1], torch.tensor([sequence[: at + 1]]),
                                       torch.tensor([result.token_ids[:i]]), params)[0].log()
        assert entry.token_id == sequence[at + 1] and math.isfinite(entry.logprob)  # drawn from that distribution
        assert _close(entry.logprob, float(expected[entry.token_id])), (i, entry, float(expected[entry.token_id]))
        assert all(_close(v, float(expected[t])) for t, v in entry.top), (i, entry)
        assert all(_close(v, w) for (_, v), w in zip(entry.top, expected.topk(len(entry.top)).values.tolist()))


#: top_k 3 < TOP: the 4th and 5th most likely tokens are filtered out (-inf) in processed mode
SAMPLED = SamplingParams(temperature=0.8, top_k=3, top_p=0.95, **PENALTIES)


@functools.lru_cache(maxsize=None)
def _sharp_model():
    """The float64 model with its logits times 6: distributions peaked enough that the target's
    argmax, drafted deterministically, is often accepted."""
    model = tiny_llama(vocab_size=64, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return model


@pytest.mark.parametrize("drafter, mode", [("target", "processed"), ("tree", "processed"), ("tree", "raw")])
def test_sampled_logprobs_are_the_targets_at_each_position(drafter, mode):
    """Seeded sampling with every stage of the pipeline on, drafts accepted and rejected (the chain
    drafter draws from the target's distribution at half the logits, the tree drafter its top two
    deterministically): each reported logprob and top-N entry is the reference's at its position,
    -inf where the filters drop one of the top tokens (processed)."""
    model = _sharp_model()
    with _decoder(model, drafter, len(PROMPTS), scale=0.5) as dec:
        results = dec.generate_ids(PROMPTS, max_new_tokens=N, seed=11, logprobs=TOP, logprobs_mode=mode,
                                   **SAMPLED.model_dump(exclude_defaults=True))
    assert sum(r.stats.accepted_tokens for r in results) > 0
    for prompt, result in zip(PROMPTS, results):
        _check_against_reference(model, prompt, result, SAMPLED, mode)
    filtered = [v for r in results for e in r.logprobs for _, v in e.top if v == -math.inf]
    assert bool(filtered) == (mode == "processed")


def test_greedy_logprobs_against_the_reference():
    """Greedy with penalties, a tree drafter: processed is the penalized logits' log-softmax (no
    temperature), as transformers computes it."""
    model = _model(torch.float64)
    for prompt, result in zip(PROMPTS, _generate(model, "tree", logprobs=TOP, **PENALTIES)):
        _check_against_reference(model, prompt, result, SamplingParams(**PENALTIES), "processed")


@pytest.mark.parametrize("kwargs, says", [
    (dict(logprobs=21), "logprobs must be an integer from 0 to 20"),
    (dict(logprobs=-1), "logprobs must be an integer from 0 to 20"),
    (dict(logprobs=True), "logprobs must be an integer"),
    (dict(logprobs=2.0), "logprobs must be an integer"),
    (dict(logprobs=2, logprobs_mode="logits"), "logprobs_mode must be one of 'processed', 'raw'"),
    (dict(logprobs_mode=None), "logprobs_mode must be one of"),
])
def test_bad_logprobs_settings_are_config_errors(kwargs, says):
    with SpeculativeDecoder(_model(torch.float32), None, drafter="none") as dec:
        for call in (lambda: dec.generate_ids(PROMPTS[:1], max_new_tokens=2, **kwargs),
                     lambda: dec.stream_ids(PROMPTS[0], max_new_tokens=2, **kwargs)):
            with pytest.raises(ConfigError, match=says) as caught:
                call()
            assert "\n" not in str(caught.value)
        assert dec.generate_ids(PROMPTS[:1], max_new_tokens=2, logprobs=0)[0].logprobs[0].top == ()
