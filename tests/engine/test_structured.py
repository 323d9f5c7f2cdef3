"""Structured output under speculation, on tiny float64 models with a tokenizer llguidance reads
(:func:`specdraft.testing.structured.tiny_bpe_tokenizer`).

The references are plain decoding under the grammar written without specdraft's code (a full
forward per token, the allowed tokens from a fresh llguidance matcher per prefix): greedy output
equals it token for token with every kind of draft (chains, trees, drafts the grammar forbids),
and sampled output follows its exact distribution (chi-square at ALPHA). The matcher's masks
along chains and trees equal fresh matchers' at every node. The real default model: tests/e2e/
test_structured_e2e.py; the server: tests/server/test_structured_server.py.
"""

from __future__ import annotations

import ctypes
import json
import random
import re

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs pip install 'specdraft[structured]'")

import llguidance  # noqa: E402

from specdraft import ConfigError, SamplingParams, SpeculativeDecoder  # noqa: E402
from specdraft.drafters.api import Drafter  # noqa: E402
from specdraft.grammar import GrammarCompiler, GrammarSpec  # noqa: E402
from specdraft.structured import from_cli, guided, one_of, response_format, structured_outputs  # noqa: E402
from specdraft.testing import SIGNIFICANCE as ALPHA  # noqa: E402
from specdraft.testing import TargetDrafter, chi_square_pvalue, random_heads, tiny_llama  # noqa: E402
from specdraft.testing.structured import (EOS, allowed_after, greedy_under_grammar,  # noqa: E402
                                          sampling_under_grammar, tiny_bpe_tokenizer)
from specdraft.types import Draft  # noqa: E402

CHOICES = ["yes", "no", "red", "blue", "bay"]
REGEX = "(yes|no)( (red|blue))*"
SCHEMA = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
          "required": ["c", "n"], "additionalProperties": False}
#: response_format -> llguidance's grammar text for the references
FORMATS = {
    "choice": ({"type": "choice", "choice": CHOICES}, llguidance.grammar_from("choice", json.dumps(CHOICES))),
    "regex": ({"type": "regex", "regex": REGEX}, llguidance.LLMatcher.grammar_from_regex(REGEX)),
    "json_schema": ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                    llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)),
}
#: samples of the sampled tests: a chi-square test at ALPHA with 12 degrees of freedom detects a deviation
#: of Cohen's w = 0.1 from the exact law with probability 0.9 (specdraft.testing.samples_needed(12) = 3,701)
SAMPLES = 4000
TREE = {"min_confidence": 0.0, "tree_budget": 8, "tree_width": 2}


@pytest.fixture(scope="module")
def bpe():
    return tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def model(bpe):
    model = tiny_llama(vocab_size=len(bpe), seed=3)
    with torch.no_grad():  # sharper than random, so drafts are accepted and outputs end
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def prompts(bpe):
    return [bpe(text, add_special_tokens=False).input_ids for text in ("yes no red", "blue bay", '{"c":"red","n":1}')]


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    """Random Medusa heads for ``model``: the tree drafter (top-k per head, pruned to a budget)."""
    return str(random_heads("medusa", model, tmp_path_factory.mktemp("structured-medusa"), scale=0.05))


def _decoder(model, bpe, kind, heads, **extra):
    if kind == "target":  # the target's own unconstrained argmax: often a token the grammar forbids
        return SpeculativeDecoder(model, bpe, drafter=TargetDrafter(model, scale=1.0, one_hot=True), spec_length=3,
                                  adaptive=False, **extra)
    if kind == "tree":
        return SpeculativeDecoder(model, bpe, drafter="medusa", spec_length=3, adaptive=False,
                                  drafter_options={"heads": heads, **TREE}, **extra)
    return SpeculativeDecoder(model, bpe, drafter=kind, spec_length=3, adaptive=False, **extra)


def _matches(name: str, text: str) -> bool:
    if name == "choice":
        return text in CHOICES
    if name == "regex":
        return re.fullmatch(REGEX, text) is not None
    value = json.loads(text)
    return set(value) == {"c", "n"} and value["c"] in ("red", "blue") and isinstance(value["n"], int)


# -- the masks --------------------------------------------------------------------------------


def _allowed(words) -> list[int]:
    return [i for i in range(len(words) * 32) if int(words[i >> 5]) >> (i & 31) & 1]


@pytest.mark.parametrize("name", list(FORMATS))
def test_masks_along_chains_and_trees_equal_fresh_matchers(bpe, name):
    """Random trees (and chains) of real and forbidden tokens: every reachable node's mask is a fresh
    matcher's after the node's path; past a forbidden token or EOS every bit is set; the matcher
    ends where it started."""
    compiler = GrammarCompiler(bpe, len(bpe), (EOS,))
    rf, grammar = FORMATS[name]
    matcher = compiler.compile(response_format(rf)).matcher()
    rng = random.Random(0)
    start = allowed_after(bpe, grammar, [])
    bits = np.zeros((13, (compiler.vocab_size + 31) // 32), dtype=np.uint32)
    reached = 0
    for trial in range(30):
        n = rng.randrange(1, 13)
        parents = None if trial % 3 == 0 else [rng.randrange(-1, i) for i in range(n)]
        tokens, paths = [], []
        for i in range(n):
            path = [] if (parents is None and i == 0) or (parents is not None and parents[i] < 0) else \
                paths[i - 1 if parents is None else parents[i]]
            allowed = allowed_after(bpe, grammar, path) if path is not None else list(range(len(bpe)))
            token = rng.choice(allowed) if rng.random() < 0.8 else rng.randrange(len(bpe))
            tokens.append(token)
            ok = path is not None and token in allowed and token != EOS
            paths.append(path + [token] if ok else None)
        assert matcher.fill(bits, tokens, parents, frozenset([EOS]))
        assert _allowed(bits[0]) == start
        for i, path in enumerate(paths):
            if path is None:
                assert _allowed(bits[i + 1]) == list(range(bits.shape[1] * 32))  # unreachable
            else:
                assert _allowed(bits[i + 1]) == allowed_after(bpe, grammar, path), (tokens, parents, i)
                reached += 1
    matcher.fill(bits, [], None, frozenset([EOS]))
    assert _allowed(bits[0]) == start
    assert reached > 60


def test_compiled_once_and_least_recently_used_out(bpe):
    compiler = GrammarCompiler(bpe, len(bpe), (EOS,), cache_size=2)
    specs = [GrammarSpec("regex", r) for r in ("yes", "no", "red")]
    first = compiler.compile(specs[0])
    assert compiler.compile(GrammarSpec("regex", "yes", field="guided_regex")).template is first.template
    compiler.compile(specs[1])
    compiler.compile(specs[0])  # used again: "no" is now the oldest
    compiler.compile(specs[2])
    assert list(compiler._compiled) == [specs[0], specs[2]]


# -- greedy: exactly plain decoding under the grammar -----------------------------------------


@pytest.fixture(scope="module")
def references(model, bpe, prompts):
    """Plain greedy decoding under each grammar of each prompt: ``{(name, prompt index): tokens}``."""
    return {(name, i): greedy_under_grammar(model, bpe, p, FORMATS[name][1], max_new_tokens=NEW)
            for name in FORMATS for i, p in enumerate(prompts)}


NEW = 14


@pytest.mark.parametrize("kind", ["none", "ngram", "prompt-lookup", "target", "tree"])
def test_greedy_equals_plain_decoding_under_the_grammar(model, bpe, prompts, heads, references, kind):
    """Every prompt under every grammar in one batch (and a row without one): token for token what
    plain greedy decoding under the grammar gives (most prompts read from the prefix cache); a
    complete output matches its grammar."""
    dec = _decoder(model, bpe, kind, heads, max_batch=10)
    plain = SpeculativeDecoder(model, bpe, drafter="none").generate_ids(prompts[:1], max_new_tokens=NEW)[0]
    jobs = [(name, i) for name in FORMATS for i in range(len(prompts))]
    streams = [dec.stream_ids(prompts[i], max_new_tokens=NEW, response_format=FORMATS[name][0]) for name, i in jobs]
    free = dec.stream_ids(prompts[0], max_new_tokens=NEW)
    for stream in streams + [free]:
        for _ in stream:
            pass
    for (name, i), stream in zip(jobs, streams):
        r = stream.result
        assert r.token_ids == references[name, i], (name, i)
        if r.finish_reason == "eos":
            assert _matches(name, r.text), r.text
    assert free.result.token_ids == plain.token_ids
    assert sum(s.result.finish_reason == "eos" for s in streams) >= 4
    # each prompt runs under every grammar: all but the first read its prompt from the prefix cache
    assert sum(s.result.stats.cached_tokens > 0 for s in streams + [free]) >= len(streams) + 1 - len(prompts)
    if kind in ("target", "tree"):
        stats = [s.result.stats for s in streams]
        assert sum(s.accepted_tokens for s in stats) > 0
        assert sum(s.accepted_tokens for s in stats) < sum(s.drafted_tokens for s in stats)  # some refused


class ForbiddenDrafter(Drafter):
    """Drafts ``k`` copies of one token the grammar never allows (``}`` in a choice of words)."""

    api_version = 2

    def __init__(self, token: int):
        super().__init__(None, None)
        self.token = token

    def propose(self, ctx, k):
        return Draft(token_ids=torch.full((len(ctx.token_ids), k), self.token, dtype=torch.long, device=ctx.device))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_the_grammar_forbids_are_rejected(model, bpe, prompts, temperature):
    forbidden = bpe.convert_tokens_to_ids("}")
    dec = SpeculativeDecoder(model, bpe, drafter=ForbiddenDrafter(forbidden), spec_length=3, adaptive=False)
    rf, grammar = FORMATS["choice"]
    results = dec.generate_ids(prompts * 4, max_new_tokens=10, temperature=temperature, seed=5, response_format=rf)
    assert sum(r.stats.drafted_tokens for r in results) > 0
    assert sum(r.stats.accepted_tokens for r in results) == 0
    for prompt, r in zip(prompts * 4, results):
        assert forbidden not in r.token_ids and r.finish_reason == "eos" and r.text in CHOICES
        if temperature == 0.0:
            assert r.token_ids == greedy_under_grammar(model, bpe, prompt, grammar)


# -- sampled: exactly plain sampling under the grammar ------------------------------------------


@pytest.mark.parametrize("kind", ["target", "tree"])
def test_sampled_outputs_follow_plain_sampling_under_the_grammar(model, bpe, kind):
    """Whole outputs (every tokenization of every choice, up to EOS) against plain sampling's exact
    law under the grammar: one chi-square test at ALPHA = 1e-3 over SAMPLES seeded samples (fixed seed,
    so the run is deterministic). The target drafter drafts from the unconstrained distribution
    (its drafts often forbidden: rejected, the residual resampled); suffix drafts trees of what earlier
    samples emitted (deterministic drafts: one-hot)."""
    rf, grammar = FORMATS["choice"]
    params = SamplingParams(temperature=1.0)
    prompt = [3]  # nothing to prefill
    exact = sampling_under_grammar(model, bpe, prompt, grammar, params)
    if kind == "target":
        dec = SpeculativeDecoder(model, bpe, drafter=TargetDrafter(model, scale=0.5), spec_length=3, adaptive=False,
                                 max_batch=512)
    else:  # trees from earlier samples' outputs
        dec = SpeculativeDecoder(model, bpe, drafter="suffix", spec_length=3, adaptive=False, max_batch=512,
                                 drafter_options={"tree_budget": 8, "min_prob": 0.0})
    results = dec.generate_ids([prompt] * SAMPLES, max_new_tokens=8, seed=11, response_format=rf, **params.model_dump())
    outputs = list(exact)
    index = {o: i for i, o in enumerate(outputs)}
    assert all(tuple(r.token_ids) in index for r in results)  # nothing plain sampling cannot emit
    counts = torch.bincount(torch.tensor([index[tuple(r.token_ids)] for r in results]), minlength=len(outputs))
    assert chi_square_pvalue(counts, torch.tensor([exact[o] for o in outputs])) > ALPHA
    assert len(outputs) > 8 and sum(counts > 0) > 8  # several tokenizations of several choices
    stats = [r.stats for r in results]
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.drafted_tokens for s in stats)
    if kind == "tree":
        assert sum(s.drafted_tokens for s in stats) > sum(sum(s.drafted_per_position) for s in stats)  # branches


# -- the end of the output: min_tokens, stop tokens, ignore_eos -----------------------------------


@pytest.mark.parametrize("kind", ["ngram", "target", "tree"])
def test_min_tokens_holds_the_end_only_while_the_grammar_allows_more(model, bpe, prompts, heads, kind):
    plain = _decoder(model, bpe, "none", heads)
    dec = _decoder(model, bpe, kind, heads)
    for rf, min_tokens in ((FORMATS["regex"][0], 6), (FORMATS["choice"][0], 9)):
        want = plain.generate_ids(prompts, max_new_tokens=14, min_tokens=min_tokens, response_format=rf)
        got = dec.generate_ids(prompts, max_new_tokens=14, min_tokens=min_tokens, response_format=rf)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        for r in got:
            if rf["type"] == "regex":  # more can always follow: EOS waits for min_tokens
                assert len(r.token_ids) > min_tokens or r.finish_reason == "length"
            else:  # every choice is shorter than min_tokens: the grammar ends it
                assert r.finish_reason == "eos" and r.token_ids[-1] == EOS and r.text in CHOICES


def test_stop_token_ids_end_a_complete_output_too(model, bpe, prompts, heads):
    stop = bpe.convert_tokens_to_ids("}")
    rf = FORMATS["choice"][0]
    want = _decoder(model, bpe, "none", heads).generate_ids(prompts, max_new_tokens=10, stop_token_ids=[stop],
                                                                 response_format=rf)
    got = _decoder(model, bpe, "target", heads).generate_ids(prompts, max_new_tokens=10, stop_token_ids=[stop],
                                                                  response_format=rf)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(r.token_ids[-1] in (EOS, stop) and r.text in CHOICES for r in got)


def test_refused_settings_and_bad_grammars(model, bpe, monkeypatch):
    dec = SpeculativeDecoder(model, bpe, drafter="ngram")
    with pytest.raises(ConfigError, match="^ignore_eos cannot be combined with response_format"):
        dec.generate_ids([[3, 4]], response_format={"type": "json_object"}, ignore_eos=True)
    with pytest.raises(ConfigError, match=r"^response_format\.regex: invalid regex: .*unclosed group"):
        dec.generate_ids([[3, 4]], response_format={"type": "regex", "regex": "(yes"})
    with pytest.raises(ConfigError, match="^response_format: invalid json schema: .*nonsense"):
        dec.generate_ids([[3, 4]], response_format={"type": "json_schema",
                                                     "json_schema": {"schema": {"type": "nonsense"}}})
    with pytest.raises(ConfigError, match="needs the model's tokenizer"):
        SpeculativeDecoder(model, None, drafter="ngram").generate_ids([[3, 4]], response_format="json_object")
    import specdraft.structured

    monkeypatch.setattr(specdraft.structured, "available", lambda: False)
    with pytest.raises(ConfigError, match=r"^response_format: structured output needs the llguidance package.*"
                                          r"pip install 'specdraft\[structured\]'$"):
        dec.generate_ids([[3, 4]], response_format={"type": "json_object"})


def test_a_grammar_that_accepts_nothing_is_refused_before_it_runs(model, bpe):
    """``{"$ref": "#"}`` accepts no JSON at all: it answered "" with finish "stop" (the empty
    mask let the end through); now a ConfigError naming the field, and not cached."""
    dec = SpeculativeDecoder(model, bpe, drafter="ngram")
    endless = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
    for _ in range(2):  # refused again: nothing failed was cached
        with pytest.raises(ConfigError, match=r"^response_format: this json schema") as caught:
            dec.generate_ids([[3, 4]], response_format=endless)
        assert caught.value.param == "response_format"


class _EmptyAfter:
    """An llguidance matcher whose masks come out empty after ``ok`` of them (a grammar that runs
    into a dead end, or llguidance failing without saying so)."""

    def __init__(self, matcher, ok: int) -> None:
        self._matcher, self.ok = matcher, ok

    def unsafe_compute_mask_ptr(self, ptr, size):
        self._matcher.unsafe_compute_mask_ptr(ptr, size)
        self.ok -= 1
        if self.ok < 0:
            ctypes.memset(ptr, 0, size)

    def __getattr__(self, name):
        return getattr(self._matcher, name)


def test_an_empty_mask_ends_the_request_with_an_error_never_an_end_token(model, bpe, prompts, monkeypatch):
    """No path lets the end tokens through because a mask allowed nothing: the request fails,
    naming the grammar engine, and the grammar leaves the compile cache."""
    from specdraft import grammar as grammar_module
    from specdraft.errors import SpecdraftError

    forgotten = []
    real_matcher, real_forget = grammar_module.Grammar.matcher, grammar_module.GrammarCompiler.forget

    def planted(self):
        m = real_matcher(self)
        m._matcher = _EmptyAfter(m._matcher, ok=1)
        return m

    monkeypatch.setattr(grammar_module.Grammar, "matcher", planted)
    monkeypatch.setattr(grammar_module.GrammarCompiler, "forget",
                        lambda self, spec: (forgotten.append(spec), real_forget(self, spec)))
    dec = SpeculativeDecoder(model, bpe, drafter="ngram", spec_length=3, adaptive=False)
    with pytest.raises(SpecdraftError, match="structured output failed.*allows no token here"):
        dec.generate_ids(prompts[:1], max_new_tokens=12, response_format=FORMATS["regex"][0])
    assert len(forgotten) == 1 and forgotten[0].kind == "regex"


# -- reading the options ------------------------------------------------------------------------


def test_response_format_forms():
    assert response_format(None) is None and response_format({"type": "text"}) is None
    assert response_format("json_object") == response_format({"type": "json_object"}) == \
        GrammarSpec("json_schema", '{"type":"object"}')
    spec = response_format({"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                    "schema": {"type": "object", "properties": {}}}})
    assert spec == GrammarSpec("json_schema", '{"type":"object","properties":{}}')
    assert response_format({"type": "regex", "regex": "a+"}) == GrammarSpec("regex", "a+")
    assert response_format({"type": "choice", "choice": ["a", "b"]}) == GrammarSpec("choice", '["a", "b"]')
    assert response_format({"type": "grammar", "grammar": 'start: "a"'}) == GrammarSpec("grammar", 'start: "a"')
    assert guided("json", '{"type": "integer"}', "guided_json") == GrammarSpec("json_schema", '{"type":"integer"}')
    assert structured_outputs({"choice": ["x"]}) == GrammarSpec("choice", '["x"]')
    assert structured_outputs({"json_object": True}).field == "structured_outputs.json_object"


@pytest.mark.parametrize("value,says", [
    (5, "^response_format: must be an object"),
    ({"type": "xml"}, r"^response_format\.type: must be one of"),
    ({"type": "json_schema"}, r"^response_format\.json_schema: required"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, r"^response_format\.json_schema\.schema: required"),
    ({"type": "json_schema", "json_schema": {"schema": []}},
     r"^response_format\.json_schema\.schema: a JSON schema must"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, r"json_schema\.strict: must be true"),
    ({"type": "json_object", "schema": {}}, "^response_format: unknown key 'schema'"),
    ({"type": "choice", "choice": []}, r"^response_format\.choice: must be a non-empty list"),
    ({"type": "regex", "regex": ""}, r"^response_format\.regex: a regular expression must be a non-empty string"),
    ({"type": "regex", "regex": "a" * 100_001}, r"^response_format\.regex: the regex has 100001 characters; at most "
                                                r"100000 are served$"),
    # past llguidance's limits only partway through an answer (issue 47: a 500 after a few tokens)
    ({"type": "regex", "regex": "b{1000000}"}, r"^response_format\.regex: the regex repeats 1000000 times; at most "
                                               r"10000 are served"),
    ({"type": "choice", "choice": [f"option {i}" for i in range(2100)]},
     r"^response_format\.choice: 2100 choices; at most 1000 are served"),
])
def test_bad_response_formats_name_the_field(value, says):
    with pytest.raises(ConfigError, match=says):
        response_format(value)


def test_vllm_fields_and_one_grammar_per_request():
    with pytest.raises(ConfigError, match="^structured_outputs: set one of .*, not json and regex"):
        structured_outputs({"json": {}, "regex": "a"})
    with pytest.raises(ConfigError, match="^structured_outputs: unknown key 'structural_tag'"):
        structured_outputs({"structural_tag": "x"})
    with pytest.raises(ConfigError, match="^guided_json: not valid JSON"):
        guided("json", "{", "guided_json")
    with pytest.raises(ConfigError, match="^guided_regex: cannot be combined with response_format"):
        one_of({"response_format": GrammarSpec("regex", "a"), "guided_regex": GrammarSpec("regex", "b")})


def test_cli_flags(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert from_cli(None, str(schema), None) == GrammarSpec("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    fmt = tmp_path / "format.json"
    fmt.write_text(json.dumps(FORMATS["choice"][0]))
    assert from_cli(str(fmt), None, None) == GrammarSpec("choice", json.dumps(CHOICES))
    assert from_cli("json_object", None, None).field == "--response-format"
    assert from_cli(None, None, "a+").field == "--regex"
    with pytest.raises(ConfigError, match="^--regex: cannot be combined with --json-schema"):
        from_cli(None, str(schema), "a+")
    with pytest.raises(ConfigError, match="^--json-schema nope.json: cannot read it"):
        from_cli(None, "nope.json", None)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="^--response-format .*bad.json: not valid JSON"):
        from_cli(str(tmp_path / "bad.json"), None, None)
