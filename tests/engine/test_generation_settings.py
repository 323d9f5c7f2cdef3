"""``ignore_eos``, ``min_tokens`` and ``stop_token_ids`` (vLLM's semantics), exact under speculation.

``min_tokens`` sets the probability of EOS (unless ``ignore_eos``) and of the stop tokens to 0 in
the target's distribution at every verified position that would be one of the first
``min_tokens`` outputs, before acceptance. The references here are written without specdraft's
code: a naive loop over the model's logits with the same mask (greedy), and an enumeration of the
masked distribution with transformers' processors (sampled, chi-square at
``specdraft.testing.SIGNIFICANCE``). The drafters include ones that propose the held-back tokens
where the mask forbids them (the target's own unmasked choices, as chains and as trees), so the
mask is what rejects them.
"""

from __future__ import annotations

import functools

import pytest
import torch

from specdraft import GenerationSettings, SamplingParams, SpeculativeDecoder
from specdraft.errors import ConfigError
from specdraft.testing import (SIGNIFICANCE, TargetDrafter, enumerate_plain_sampling, repetitive_prompts,
                               samples_needed, samples_pvalue, tiny_llama, tiny_tokenizer)
from specdraft.testing.drafters import TopTwoTree
from specdraft.testing.stats import family_size

N = 20
PROMPTS = repetitive_prompts(64)


def _model(vocab: int = 64, eos: int | None = None, sharpen: float = 1.0):
    """A tiny float64 Llama whose config names ``eos`` as its end-of-sequence token."""
    model = tiny_llama(vocab_size=vocab, seed=0 if vocab == 64 else 1)
    if sharpen != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    model.config.eos_token_id = eos
    return model


def naive_greedy(model, prompt, max_new_tokens, eos=(), *, ignore_eos=False, min_tokens=0, stop_token_ids=()):
    """Plain greedy decoding written out: the model's logits for the next token (transformers'
    own forward and cache), the held-back tokens' logits -inf while fewer than ``min_tokens`` are
    out, the argmax; ends at EOS (unless ``ignore_eos``) or a stop token. Returns ``(tokens,
    finish_reason)``."""
    held = set(stop_token_ids) | (set() if ignore_eos else set(eos))
    out, cache, feed = [], None, torch.tensor([list(prompt)])
    with torch.no_grad():
        while len(out) < max_new_tokens:
            step = model(feed, past_key_values=cache, use_cache=True)
            cache, logits = step.past_key_values, step.logits[0, -1].double()
            if len(out) < min_tokens:
                logits[list(held)] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            feed = torch.tensor([[token]])
            if token in eos and not ignore_eos:
                return out, "eos"
            if token in stop_token_ids:
                return out, "stop"
    return out, "length"


@functools.lru_cache(maxsize=None)
def _shared_model(eos: int | None):
    return _model(eos=eos)


@functools.lru_cache(maxsize=None)
def _expected(eos: int, prompt: tuple, settings: tuple):
    """:func:`naive_greedy` of the vocabulary-64 model with EOS ``eos``, computed once per module."""
    return naive_greedy(_shared_model(eos), prompt, N, (eos,), **dict(settings))


def expected(eos, prompt, settings):
    return _expected(eos, tuple(prompt), tuple((k, tuple(v) if isinstance(v, list) else v)
                                               for k, v in sorted(settings.items())))


DRAFTERS = {
    "ngram": ("ngram", {}),
    "prompt-lookup": ("prompt-lookup", {}),
    "ngram-tree": ("ngram", {"tree_budget": 8}),
    "prompt-lookup-tree": ("prompt-lookup", {"tree_budget": 8}),
    "target-chain": (lambda m: TargetDrafter(m, scale=1.0), None),  # greedy: the unmasked argmax
    "target-tree": (TopTwoTree, None),
}


def _decoder(model, name, spec_length=4, **kwargs):
    drafter, options = DRAFTERS[name]
    if options is None:
        return SpeculativeDecoder(model, None, drafter=drafter(model), spec_length=spec_length, **kwargs)
    return SpeculativeDecoder(model, None, drafter=drafter, drafter_options=options, spec_length=spec_length,
                              **kwargs)


@pytest.fixture(scope="module")
def plain():
    """Prompt 0's plain greedy output with no EOS at all (its third token becomes the EOS below)."""
    out, _ = naive_greedy(_shared_model(None), PROMPTS[0], N)
    assert len(set(out[:5])) == 5, out  # distinct early tokens: each setting below changes the output
    return out


def _cases(plain):
    """(settings, EOS id): EOS is the token plain greedy emits third, stop tokens its second and fifth."""
    eos = plain[2]
    return [
        ({}, eos),
        ({"min_tokens": 6}, eos),
        ({"ignore_eos": True}, eos),
        ({"stop_token_ids": [plain[4]]}, eos),
        ({"min_tokens": 4, "stop_token_ids": [plain[1], plain[4]]}, eos),
        ({"min_tokens": 5, "ignore_eos": True, "stop_token_ids": [plain[3]]}, eos),
    ]


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_parity_with_a_naive_masked_loop(plain, drafter):
    model = _shared_model(plain[2])
    dec = _decoder(model, drafter)
    assert dec.target.eos_token_ids == (plain[2],)
    if "tree" in drafter:
        assert dec.engine.verifier.trees
    for settings, eos in _cases(plain):
        results = dec.generate_ids(PROMPTS, max_new_tokens=N, **settings)
        got = [(r.token_ids, r.finish_reason) for r in results]
        assert got == [expected(eos, p, settings) for p in PROMPTS], settings
    # the settings change what plain decoding gives (else the test would prove little)
    assert expected(plain[2], PROMPTS[0], {}) == (plain[:3], "eos")
    assert expected(plain[2], PROMPTS[0], {"min_tokens": 6})[0][:3] != plain[:3]


def test_drafts_of_held_back_tokens_are_rejected(plain):
    """The target's unmasked argmax proposes EOS at the third token; with ``min_tokens`` the
    masked target refuses it there (and the Predicted Outputs path, the same)."""
    model = _shared_model(plain[2])
    dec = _decoder(model, "target-chain", adaptive=False)
    [r] = dec.generate_ids([PROMPTS[0]], max_new_tokens=N, min_tokens=6)
    assert r.token_ids == expected(plain[2], PROMPTS[0], {"min_tokens": 6})[0]
    assert r.stats.accepted_tokens < r.stats.drafted_tokens  # the EOS draft was refused
    none = SpeculativeDecoder(model, None, drafter="none", spec_length=4, adaptive=False)
    [p] = none.generate_ids([PROMPTS[0]], max_new_tokens=N, min_tokens=6, prediction=[plain])
    assert p.token_ids == r.token_ids and p.stats.rejected_prediction_tokens > 0


def test_rows_with_different_settings_share_passes(plain):
    """Each row's own mask and end conditions, in one batch (streams submitted together)."""
    dec = _decoder(_shared_model(plain[2]), "ngram-tree")
    cases = _cases(plain)
    streams = [dec.stream_ids(PROMPTS[i % len(PROMPTS)], max_new_tokens=N, **settings)
               for i, (settings, _) in enumerate(cases)]
    for i, ((settings, eos), stream) in enumerate(zip(cases, streams)):
        tokens = [t for chunk in stream for t in chunk.token_ids]
        assert (tokens, stream.result.finish_reason) == expected(eos, PROMPTS[i % len(PROMPTS)], settings), settings


def test_text_without_the_stop_token_and_stop_strings_after_min_tokens(plain):
    """A stop token stays in the token ids, not in the text (streamed or not); a stop string
    that ends before ``min_tokens`` does not count, and the text is cut at the first one that does."""
    model = _shared_model(None)
    tok = tiny_tokenizer(64)
    dec = SpeculativeDecoder(model, tok, drafter="ngram", spec_length=4)
    words = [f"t{t}" for t in plain]
    assert len(set(words[:8])) == 8
    [r] = dec.generate_ids([PROMPTS[0]], max_new_tokens=N, stop_token_ids=[plain[3]])
    assert (r.token_ids, r.finish_reason, r.text) == (plain[:4], "stop", " ".join(words[:3]))
    stream = dec.stream_ids(PROMPTS[0], max_new_tokens=N, stop_token_ids=[plain[3]])
    assert "".join(chunk.text for chunk in stream) == r.text == stream.result.text

    # stop strings: words[1] ends before min_tokens (ignored), words[6] after it (ends the request)
    stop = [words[1], words[6]]
    [early] = dec.generate_ids([PROMPTS[0]], max_new_tokens=N, stop=stop)
    assert early.finish_reason == "stop" and early.text == words[0] + " "
    [late] = dec.generate_ids([PROMPTS[0]], max_new_tokens=N, stop=stop, min_tokens=4)
    assert late.finish_reason == "stop" and late.token_ids == plain[:7]
    assert late.text == " ".join(words[:6]) + " "
    stream = dec.stream_ids(PROMPTS[0], max_new_tokens=N, stop=stop, min_tokens=4)
    assert "".join(chunk.text for chunk in stream) == late.text

    # ignore_eos: EOS (here a word) is emitted like any other token and generation goes on
    dec = SpeculativeDecoder(_shared_model(plain[2]), tok, drafter="ngram", spec_length=4)
    [r] = dec.generate_ids([PROMPTS[0]], max_new_tokens=N)
    assert (r.token_ids, r.finish_reason, r.text) == (plain[:3], "eos", " ".join(words[:3]))
    [free] = dec.generate_ids([PROMPTS[0]], max_new_tokens=N, ignore_eos=True)
    assert (free.token_ids, free.finish_reason, free.text) == (plain, "length", " ".join(words))


def test_generate_decodes_its_text_once_and_a_stream_adds_up_to_it(plain):
    """``generate`` makes no text per burst (each a decode, on a thread beside the engine's steps):
    its text is decoded once, at the end, and equals what a stream's bursts put together give
    (each burst decoding)."""
    tok = tiny_tokenizer(64)
    lengths, decode = [], tok.decode
    tok.decode = lambda ids, **kw: lengths.append(len(ids)) or decode(ids, **kw)
    dec = SpeculativeDecoder(_shared_model(None), tok, drafter="ngram", spec_length=4)
    [r] = dec.generate_ids([PROMPTS[0]], max_new_tokens=N)
    assert r.text == " ".join(f"t{t}" for t in plain) and r.stats.target_passes >= 3
    assert lengths == [N]
    lengths.clear()
    stream = dec.stream_ids(PROMPTS[0], max_new_tokens=N)
    chunks = list(stream)
    assert "".join(c.text for c in chunks) == r.text == stream.result.text
    assert len(lengths) > len([c for c in chunks if c.token_ids]) >= 3


# -- sampled -------------------------------------------------------------------------------------

SAMPLED_PROMPT = [3, 5, 3, 5, 3]


def masked_enumeration(model, prompt, params, steps, held, min_tokens):
    """P(first ``steps`` tokens) under plain sampling with ``held`` given logit -inf at the first
    ``min_tokens`` positions: every prefix enumerated, transformers' processors on the masked raw
    logits, no specdraft code."""
    def mask(level, logits):
        logits = logits.double()
        if level < min_tokens:
            logits[:, list(held)] = float("-inf")
        return logits

    return enumerate_plain_sampling(model, prompt, params, steps, adjust=mask)


@pytest.mark.parametrize("drafter", ["target-chain-sampled", "target-tree"])
def test_sampling_with_min_tokens_follows_the_masked_target(drafter):
    """The two most likely first tokens are EOS and a stop token; ``min_tokens=2`` holds them back
    at the first two positions (the drafters propose them there: rejection and the residual see
    them) and lets them come at the third. A chain drafted with probabilities, and a tree of
    deterministic siblings whose spine is the unmasked argmax."""
    params = SamplingParams(temperature=1.0, top_k=6)
    probe = _model(16, sharpen=8.0)
    with torch.no_grad():
        first = probe(torch.tensor([SAMPLED_PROMPT])).logits[0, -1].topk(2).indices.tolist()
    eos, stop = first
    model = _model(16, eos=eos, sharpen=8.0)
    steps, min_tokens = 3, 2
    exact = masked_enumeration(model, SAMPLED_PROMPT, params, steps, {eos, stop}, min_tokens)
    assert float(exact.marginal(2)[[eos, stop]].sum()) > 0.01  # they may come at the third token
    drafting = TargetDrafter(model, scale=0.5) if drafter == "target-chain-sampled" else TopTwoTree(model)
    dec = SpeculativeDecoder(model, None, drafter=drafting, spec_length=steps - 1, adaptive=False, max_batch=1024)
    support = max(int((exact.marginal(i) > 0).sum()) for i in range(steps))
    # effect 0.2 (not the default 0.1): what a wrong mask does (a held-back token allowed, or held
    # at the wrong position) moves the most likely token's mass, w > 1; a quarter of the samples
    n = samples_needed(support - 1, family_size(steps), effect=0.2)
    results = dec.generate_ids([SAMPLED_PROMPT] * n, max_new_tokens=steps, seed=11, min_tokens=min_tokens,
                               stop_token_ids=[stop], **params.model_dump())
    assert all(len(r.token_ids) == steps for r in results)
    samples = [r.token_ids for r in results]
    assert sum(r.stats.drafted_tokens - r.stats.accepted_tokens for r in results) > 0
    assert samples_pvalue(samples, exact) > SIGNIFICANCE
    # and the mask mattered: the unmasked target's law is far from these samples
    assert samples_pvalue(samples, enumerate_plain_sampling(model, SAMPLED_PROMPT, params, steps)) < SIGNIFICANCE


# -- bad values, the server's fields ------------------------------------------------------------------

@pytest.mark.parametrize("settings, message", [
    ({"min_tokens": -1}, r"min_tokens must be an integer from 0 to max_new_tokens \(8\) \(got -1\)"),
    ({"min_tokens": 9}, r"min_tokens must be an integer from 0 to max_new_tokens \(8\) \(got 9\)"),
    ({"min_tokens": True}, r"min_tokens must be an integer .*\(got True\)"),
    ({"min_tokens": 2.0}, r"min_tokens must be an integer .*\(got 2.0\)"),
    ({"ignore_eos": 1}, r"ignore_eos must be True or False \(got 1\)"),
    ({"ignore_eos": "yes"}, r"ignore_eos must be True or False \(got 'yes'\)"),
    ({"stop_token_ids": [64]}, r"stop_token_ids holds 64, outside the vocabulary \[0, 64\)"),
    ({"stop_token_ids": [-1]}, r"stop_token_ids holds -1, outside the vocabulary \[0, 64\)"),
    ({"stop_token_ids": ["3"]}, r"stop_token_ids holds '3' \(str\); token ids must be integers"),
    ({"stop_token_ids": [True]}, r"stop_token_ids holds True \(bool\); token ids must be integers"),
    ({"stop_token_ids": [1.5]}, r"stop_token_ids holds 1.5 \(float\); token ids must be integers"),
    ({"stop_token_ids": 5}, r"stop_token_ids must be a list of token ids \(ints\), got int"),
    ({"stop_token_ids": "5"}, r"stop_token_ids must be a list of token ids \(ints\), got str"),
    # what one request may cost the others (issue 47): documented bounds, each naming its field
    ({"stop": [f"s{i}" for i in range(65)]}, r"^stop has 65 strings; at most 64 are served$"),
    ({"stop": ["x" * 1001]}, r"^a stop string has 1001 characters; at most 1000 are served$"),
    ({"logit_bias": {str(i % 64): 1 for i in range(1025)} | {f"0{i}": 1 for i in range(1025)}},
     r"^logit_bias has 1089 entries; at most 1024 are served$"),
])
def test_bad_values_give_one_line_errors(settings, message):
    dec = SpeculativeDecoder(_shared_model(None), None, drafter="none")
    for call in (lambda: dec.generate_ids([PROMPTS[0]], max_new_tokens=8, **settings),
                 lambda: dec.stream_ids(PROMPTS[0], max_new_tokens=8, **settings)):
        with pytest.raises(ConfigError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
    assert dec.num_waiting == dec.num_running == 0


def test_the_server_passes_the_fields_to_the_decoder(plain):
    from specdraft.server.protocol import CompletionRequest

    off = CompletionRequest(prompt="x").settings(N)
    assert (off.ignore_eos, off.min_tokens, off.stop_token_ids) == (False, 0, ())
    body = CompletionRequest(prompt="x", temperature=0, min_tokens=6, stop_token_ids=[plain[4]])
    assert not body.model_extra  # declared fields, not unknown ones
    dec = SpeculativeDecoder(_shared_model(plain[2]), None, drafter="ngram")
    stream = dec.stream_ids(PROMPTS[0], body.settings(N))
    tokens = [t for chunk in stream for t in chunk.token_ids]
    settings = {"min_tokens": 6, "stop_token_ids": [plain[4]]}
    assert (tokens, stream.result.finish_reason) == expected(plain[2], PROMPTS[0], settings)


@pytest.mark.parametrize("args, message", [
    (["--min-tokens", "-1"], "min_tokens must be an integer from 0 to max_new_tokens (128) (got -1)"),
    (["--min-tokens", "200"], "min_tokens must be an integer from 0 to max_new_tokens (128) (got 200)"),
    (["--stop-token-id", "-3"], "stop_token_ids holds -3; token ids are >= 0"),
])
def test_cli_flags_fail_before_the_model_loads(monkeypatch, capsys, args, message):
    from specdraft.cli import main

    monkeypatch.setattr("specdraft.models.load_target", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["generate", "hi", *args]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"specdraft: error: {message}"]


# -- truncate_prompt_tokens (vLLM's): the prompt's last tokens ----------------------------------------


def test_truncate_prompt_tokens_decodes_the_prompts_last_tokens():
    """A cut prompt decodes exactly as that tail given whole (greedy, speculative), reports its
    own length, and may be longer than the context before the cut; a bad value is one ConfigError."""
    dec = SpeculativeDecoder(_shared_model(None), None, drafter="ngram")
    prompt = PROMPTS[0]
    [cut] = dec.generate_ids([prompt], max_new_tokens=N, truncate_prompt_tokens=5)
    [tail] = dec.generate_ids([prompt[-5:]], max_new_tokens=N)
    assert cut.token_ids == tail.token_ids == expected(None, prompt[-5:], {})[0]
    assert cut.stats.prompt_tokens == 5
    too_long = prompt * (dec.target.max_context // len(prompt) + 1)
    with pytest.raises(ConfigError, match="context holds"):
        dec.generate_ids([too_long], max_new_tokens=4)
    stream = dec.stream_ids(too_long, GenerationSettings(max_new_tokens=4, truncate_prompt_tokens=8))
    assert [t for chunk in stream for t in chunk.token_ids] == expected(None, too_long[-8:], {})[0][:4]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="truncate_prompt_tokens must be an integer >= 1") as caught:
            dec.generate_ids([prompt], max_new_tokens=4, truncate_prompt_tokens=bad)
        assert caught.value.param == "truncate_prompt_tokens"
    dec.close()
