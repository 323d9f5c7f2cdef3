"""Structured output on the real default model (float32, as users run it on CPUs): every drafter
kind (prompt-lookup, ngram, eagle's chains and trees) gives token for token what plain decoding
under the same grammar gives, for a JSON object, a JSON schema with an enum and numbers, and a
regex, all in one batch; every complete output parses and validates against its schema."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance", reason="structured output needs pip install 'specdraft[structured]'")

from specdraft import SpeculativeDecoder  # noqa: E402
from specdraft.testing.structured import PERSON_SCHEMA, is_person  # noqa: E402

pytestmark = pytest.mark.e2e
NEW = 32
REGEX = r"[A-Z][a-z]+, [0-9]{4}"
JOBS = {  # name -> (prompt, response_format)
    "json_object": ("Return JSON with keys city and country for Paris.", {"type": "json_object"}),
    "json_schema": ("Describe a person as JSON with their name, favourite colour, age and a score.",
                    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}),
    "regex": ("Name the capital of France and the year it was founded.", {"type": "regex", "regex": REGEX}),
}


def valid(name: str, text: str) -> bool:
    """Whether ``text`` is what ``name``'s format asks for (a small validator of PERSON_SCHEMA)."""
    if name == "regex":
        return re.fullmatch(REGEX, text) is not None
    value = json.loads(text)
    if name == "json_object":
        return isinstance(value, dict)
    return is_person(value)


def run_all(dec) -> dict:
    """Every job in one batch (three streams); ``{name: result}``."""
    streams = {name: dec.stream(prompt, max_new_tokens=NEW, response_format=rf) for name, (prompt, rf) in JOBS.items()}
    for stream in streams.values():
        for _ in stream:
            pass
    return {name: stream.result for name, stream in streams.items()}


@pytest.fixture(scope="module")
def plain(default_f32):
    model, tok = default_f32
    with SpeculativeDecoder(model, tok, drafter="none") as dec:
        results = run_all(dec)
    for name, r in results.items():  # each complete, and what it asks for
        assert r.finish_reason == "eos" and valid(name, r.text), (name, r.text)
    return results


@pytest.mark.parametrize("drafter,options", [
    ("prompt-lookup", None),
    ("ngram", None),
    ("eagle", None),
    ("eagle", {"tree_budget": 8, "tree_width": 2, "min_confidence": 0.0}),
], ids=["prompt-lookup", "ngram", "eagle", "eagle-tree"])
def test_greedy_structured_output_equals_plain_decoding_under_the_grammar(default_f32, plain, drafter, options):
    model, tok = default_f32
    with SpeculativeDecoder(model, tok, drafter=drafter, spec_length=3, adaptive=False, drafter_options=options) as dec:
        results = run_all(dec)
    for name, r in results.items():
        assert r.token_ids == plain[name].token_ids, name
        assert r.finish_reason == "eos" and valid(name, r.text), (name, r.text)
    stats = [r.stats for r in results.values()]
    assert sum(s.accepted_tokens for s in stats) > 0
    if options:
        assert sum(s.drafted_tokens for s in stats) > sum(sum(s.drafted_per_position) for s in stats)  # trees


def test_cli_regex_and_json_schema(cli, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    common = ("--dtype", "float32", "--max-new-tokens", "48")
    code, out, err = cli("generate", JOBS["regex"][0], "--regex", REGEX, *common)
    assert code == 0 and valid("regex", out.strip()), (out, err)
    code, out, err = cli("generate", JOBS["json_schema"][0], "--json-schema", str(schema), *common)
    assert code == 0 and valid("json_schema", out.strip()), (out, err)
