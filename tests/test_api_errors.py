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
    ({"stop": 5}, r"stop must be a string or a list of strings \(got int 5\)"),  # was a bare TypeError
    ({"stop": ["ok", 5]}, r"stop strings must be non-empty strings \(got \['ok', 5\]\)"),
    ({"seed": 2**64}, r"seed must be an integer from 0 to 2\*\*64 - 1, or None \(got 18446744073709551616\)"),
    ({"temperature": 1e-38}, "temperature: Value error, must be 0 \\(greedy\\) or from 0.0001 to 100"),
    ({"temperature": float("inf")}, "temperature: Input should be a finite number"),
    ({"temperature": float("nan")}, "temperature: Input should be a finite number"),
    ({"temperature": 101.0}, "temperature: Input should be less than or equal to 100"),
    ({"min_p": 1.5}, "min_p: Input should be less than or equal to 1"),
    ({"repetition_penalty": 0.0}, "repetition_penalty: Input should be greater than 0"),
    ({"presence_penalty": 2.5}, "presence_penalty: Input should be less than or equal to 2"),
    ({"frequency_penalty": -3.0}, "frequency_penalty: Input should be greater than or equal to -2"),
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
    ([["a"]], r"prompt 0 holds 'a' \(str\); token ids must be integers"),
    ([[1.7, 2.2]], r"prompt 0 holds 1.7 \(float\); token ids must be integers"),
    ([[1, True]], r"prompt 0 holds True \(bool\); token ids must be integers"),
    ([["ab"], "cd"], r"prompt 0 holds 'ab' \(str\)"),
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


def test_token_ids_from_numpy_and_torch_are_accepted(dec):
    import numpy as np
    import torch

    plain = dec.generate_ids([[1, 2, 3]], max_new_tokens=4)[0].token_ids
    assert dec.generate_ids(torch.tensor([[1, 2, 3]]), max_new_tokens=4)[0].token_ids == plain
    assert dec.generate_ids([np.array([1, 2, 3])], max_new_tokens=4)[0].token_ids == plain


@pytest.fixture(scope="module")
def text_dec(tiny_model):
    from specdraft.testing import tiny_tokenizer

    return SpeculativeDecoder(tiny_model, tiny_tokenizer(64), drafter="ngram", spec_length=2)


@pytest.mark.parametrize("prompts, message", [
    (None, "prompts must be a string or a list of strings, got NoneType"),
    (b"t5 t6", r"got bytes; decode bytes first \(prompt.decode\('utf-8'\)\)"),
    (["t5", 7], "prompt 1 must be a string, got int"),
    ("t5 \ud800 t6", r"prompt 0 is not valid text: surrogates not allowed at character 3 \('\\ud800'\); "
                      r"pass valid Unicode \(UTF-8\) text"),
    ("  ", "prompt 0 is empty"),
])
def test_bad_text_prompts(text_dec, prompts, message):
    with pytest.raises(ConfigError, match=message):
        text_dec.generate(prompts)


@pytest.mark.parametrize("spec_length", [0, -1, 1.5, True, 17, 1000])
def test_bad_spec_length(tiny_model, spec_length):
    with pytest.raises(ConfigError, match="spec_length must be an integer from 1 to 16"):
        SpeculativeDecoder(tiny_model, None, drafter="ngram", spec_length=spec_length)


def test_unknown_drafter(tiny_model):
    with pytest.raises(UnknownDrafterError, match="known drafters: .*ngram"):
        SpeculativeDecoder(tiny_model, None, drafter="medusa-typo")
