"""Bad input through the Python API: a ConfigError that says what to do."""

from __future__ import annotations

import pytest

from specdraft import ConfigError, SpeculativeDecoder, UnknownDrafterError


@pytest.fixture(scope="module")
def dec(tiny_model):
    return SpeculativeDecoder(tiny_model, None, drafter="ngram", spec_length=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature: Input should be greater than or equal to 0"),
    ({"top_p": 0.0}, "top_p: Input should be greater than 0"),
    ({"top_p": 1.01}, "top_p: Input should be less than or equal to 1"),
    ({"top_k": -1}, "top_k: Input should be greater than or equal to 0"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 1"),
    ({"seed": -3}, r"seed must be an integer from 0 to 2\*\*64 - 1"),
    ({"stop": [""]}, "stop strings must be non-empty"),
])
def test_bad_generation_settings(dec, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        dec.generate_ids([[1, 2, 3]], **kwargs)


@pytest.mark.parametrize("prompts, message", [
    ([], "non-empty list"),
    ([[]], "prompt 0 is empty"),
    ([1, 2, 3], "must be a list of lists"),
    ([[1, 2], [64]], r"prompt 1 has token ids outside \[0, 64\)"),
    ([[1] * 256], "prompt 0 has 256 tokens but the model's context holds 256; shorten it to at most 255"),
])
def test_bad_prompts(dec, prompts, message):
    with pytest.raises(ConfigError, match=message):
        dec.generate_ids(prompts)


def test_stop_strings_need_a_tokenizer(dec):
    with pytest.raises(ConfigError, match="need a tokenizer"):
        dec.generate_ids([[1, 2]], stop=["x"])


def test_text_prompts_need_a_tokenizer(dec):
    with pytest.raises(ConfigError, match="no tokenizer; use generate_ids"):
        dec.generate("hello")


@pytest.mark.parametrize("spec_length", [0, -1, 1.5, True])
def test_bad_spec_length(tiny_model, spec_length):
    with pytest.raises(ConfigError, match="spec_length must be an integer >= 1"):
        SpeculativeDecoder(tiny_model, None, drafter="ngram", spec_length=spec_length)


def test_unknown_drafter(tiny_model):
    with pytest.raises(UnknownDrafterError, match="known drafters: .*ngram"):
        SpeculativeDecoder(tiny_model, None, drafter="medusa-typo")
