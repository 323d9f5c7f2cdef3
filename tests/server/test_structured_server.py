"""Structured output through the server, with the official openai client over real HTTP:
``response_format`` (json_object, json_schema, and specdraft's regex / choice), vLLM's
``structured_outputs`` and ``guided_*`` fields; every bad one a 400 naming its field. A tiny model
answers the fast tests; the real default model (e2e) answers a JSON schema that must parse."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs pip install 'specdraft[structured]'")

from specdraft import SpeculativeDecoder  # noqa: E402
from specdraft.server import create_app  # noqa: E402
from specdraft.testing import tiny_llama  # noqa: E402
from specdraft.testing.structured import PERSON_SCHEMA, is_person, tiny_bpe_tokenizer  # noqa: E402

pytestmark = pytest.mark.server

CHOICES = ["yes", "no", "red", "blue", "bay"]
REGEX = "(yes|no)( (red|blue))*"


@pytest.fixture(scope="module")
def tiny(serve):
    """``(url, decoder)``: a tiny model with a tokenizer llguidance reads (and a chat template), served."""
    bpe = tiny_bpe_tokenizer()
    bpe.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model = tiny_llama(vocab_size=len(bpe), seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    with SpeculativeDecoder(model, bpe, drafter="ngram", spec_length=3) as dec:
        with serve(create_app(dec, model_name="tiny")) as url:
            yield url, dec


@pytest.fixture(scope="module")
def client(tiny):
    return openai.OpenAI(base_url=f"{tiny[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def test_every_field_constrains_the_answer_as_the_decoder_does(tiny, client):
    url, dec = tiny
    prompt = "yes no red"
    ids = dec.encode(prompt, raw=True)
    cases = [  # (the request's extra fields, the decoder's response_format)
        ({"response_format": {"type": "choice", "choice": CHOICES}}, {"type": "choice", "choice": CHOICES}),
        ({"guided_choice": CHOICES}, {"type": "choice", "choice": CHOICES}),
        ({"structured_outputs": {"regex": REGEX}}, {"type": "regex", "regex": REGEX}),
        ({"guided_regex": REGEX}, {"type": "regex", "regex": REGEX}),
    ]
    for extra, rf in cases:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
        offline = dec.generate_ids([ids], max_new_tokens=12, response_format=rf)[0]
        assert r.choices[0].text == offline.text, extra
        assert r.choices[0].finish_reason == ("stop" if offline.finish_reason == "eos" else "length")
        if offline.finish_reason == "eos":
            assert re.fullmatch(REGEX if "regex" in rf else "|".join(CHOICES), offline.text)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=12,
                                          temperature=0, response_format={"type": "choice", "choice": CHOICES})
    assert chat.choices[0].message.content in CHOICES and chat.choices[0].finish_reason == "stop"


def test_a_streamed_answer_equals_the_whole_one(client):
    kwargs = dict(model="tiny", prompt="blue bay", max_tokens=12, temperature=0, extra_body={"guided_regex": REGEX})
    whole = client.completions.create(**kwargs).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices) == whole


@pytest.mark.parametrize("route,extra,param,says", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "response_format: invalid json schema"),
    ("chat", {"response_format": "json"}, "response_format", "response_format"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema: required"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "response_format.type: must be one of"),
    ("completions", {"guided_regex": "(yes"}, "guided_regex", "guided_regex: invalid regex"),
    ("completions", {"guided_json": "{"}, "guided_json", "guided_json: not valid JSON"),
    ("completions", {"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "set one of"),
    ("completions", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "unknown key"),
    ("completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "cannot be combined with response_format"),
    ("completions", {"guided_choice": CHOICES, "ignore_eos": True}, "ignore_eos", "ignore_eos cannot be combined"),
    # issue 47: served before as "" with finish "stop" (the end let through by an empty mask, or
    # the special token generated), now refused before the request is queued
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format", "response_format: this json schema"),
    ("completions", {"guided_choice": ["</s>", "yes"]}, "guided_choice", "spells the special token '</s>'"),
    ("completions", {"guided_regex": "yes<\\/s>"}, "guided_regex", "spells the special token '</s>'"),
    ("completions", {"guided_regex": "a" * 100_001}, "guided_regex", "at most 100000 are served"),
])
def test_bad_structured_output_fields_are_a_400_naming_them(tiny, route, extra, param, says):
    url, _ = tiny
    body = {"model": "tiny", "max_tokens": 4, **extra}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "yes"}]
    else:
        body["prompt"] = "yes"
    r = httpx.post(f"{url}/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"], error
    assert "\n" not in error["message"]


def test_a_grammar_that_fails_while_it_runs_is_an_error_and_is_compiled_afresh(client, monkeypatch):
    """A grammar whose masks fail partway (planted: llguidance's limits are met only by grammars
    too big to run here) ends its request with an error naming the grammar engine, not an empty
    "stop" answer; and the next identical request is not handed the failed grammar."""
    from specdraft import grammar as grammar_module

    compiles = []  # grammars compiled, not found in the compile cache
    real_check = grammar_module.GrammarCompiler._check_start
    monkeypatch.setattr(grammar_module.GrammarCompiler, "_check_start",
                        lambda self, spec, template: (compiles.append(spec), real_check(self, spec, template)))
    real_matcher = grammar_module.Grammar.matcher

    def failing(self):
        m = real_matcher(self)
        m.error = "planted failure"  # what a matcher says once llguidance failed
        return m

    monkeypatch.setattr(grammar_module.Grammar, "matcher", failing)
    for _ in range(2):
        with pytest.raises(openai.APIError) as caught:
            client.completions.create(model="tiny", prompt="yes", max_tokens=6, temperature=0,
                                      extra_body={"guided_regex": "(yes|no)( red)*"})
        assert "structured output failed" in str(caught.value) and "planted failure" in str(caught.value)
    assert len(compiles) == 2  # the failed grammar left the cache: compiled again


def test_the_openai_client_sees_a_bad_schema_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "object", "uniqueItems": True}}})
    assert caught.value.body["param"] == "response_format"




@pytest.mark.e2e
def test_json_schema_answers_parse_on_the_default_model(default_f32, serve):
    """The real model over HTTP: a json_schema answer (greedy, prompt-lookup drafting) parses, has
    exactly the schema's fields with their types, and is the decoder's own offline answer."""
    model, tok = default_f32
    messages = [{"role": "user", "content": "Describe a person as JSON with their name, favourite colour, age and a "
                                            "score."}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    with SpeculativeDecoder(model, tok, drafter="prompt-lookup") as dec, serve(create_app(dec)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=dec.target.name, messages=messages, max_tokens=48, temperature=0,
                                           response_format=rf)
        offline = dec.generate(messages[0]["content"], max_new_tokens=48, response_format=rf)[0]
    answer = json.loads(r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == offline.text
    assert is_person(answer)
