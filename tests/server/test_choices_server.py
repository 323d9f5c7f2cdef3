"""``n`` > 1 and ``logit_bias`` over real HTTP with the openai client, on a tiny random model with
the default model's tokenizer: the choices of one request share its prompt (prefilled once), each
draws its own random numbers (a seed makes them reproducible and distinct), and whole, streamed and
Python-API answers agree choice by choice; usage counts the prompt once and every choice's tokens.
``logit_bias`` (token ids as JSON's string keys) gives the decoder's own biased answer."""

from __future__ import annotations

import openai
import pytest

from specdraft.server import create_app

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def decoder(smol_tokenizer):
    from specdraft import SpeculativeDecoder
    from specdraft.testing import tiny_llama

    model = tiny_llama(vocab_size=len(smol_tokenizer), seed=5, max_positions=256)
    with SpeculativeDecoder(model, smol_tokenizer, drafter="ngram", target_name="tiny", spec_length=3,
                            max_batch=4) as dec:
        yield dec


@pytest.fixture(scope="module")
def client(decoder, serve):
    with serve(create_app(decoder)) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def test_seeded_choices_are_reproducible_distinct_and_the_python_apis(client, decoder):
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3)
    first, again = client.completions.create(**ask), client.completions.create(**ask)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in again.choices] == texts and len(set(texts)) == 3
    local = decoder.generate(PROMPT, raw=True, max_new_tokens=8, temperature=1.0, seed=7, n=3)
    assert [r.text for r in local] == texts
    prompt_tokens = len(decoder.encode(PROMPT, raw=True))
    assert first.usage.prompt_tokens == prompt_tokens  # the prompt once, however many choices
    assert first.usage.completion_tokens == sum(len(r.token_ids) for r in local)
    one = client.completions.create(**{**ask, "n": 1})
    assert one.choices[0].text == texts[0]  # choice 0 is what n=1 gives with the seed


def test_streamed_choices_add_up_to_the_whole_answer(client):
    ask = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=6, temperature=0.8,
               seed=11, n=2)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts, finished = {0: "", 1: ""}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finished == {c.index: c.finish_reason for c in whole.choices}
    streamed = chunks[-1].usage.model_dump()
    # the same prompt again: the stream read it from the prefix cache (all but its last token)
    assert streamed["prompt_tokens_details"].pop("cached_tokens") == whole.usage.prompt_tokens - 1
    usage = whole.usage.model_dump()
    assert usage["prompt_tokens_details"].pop("cached_tokens") == 0  # the module's first request of this prompt
    assert streamed == usage


def test_each_choice_carries_its_own_logprobs(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=2, temperature=1.0, seed=3,
                                      logprobs=2)
    for choice in whole.choices:
        assert "".join(choice.logprobs.tokens) == choice.text
        assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens) >= 1


@pytest.mark.parametrize("n, says", [(0, "greater than or equal to 1"), (129, "less than or equal to 128"),
                                     (True, "valid integer")])
def test_a_bad_n_is_a_400_naming_it(client, n, says):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=n)
    assert caught.value.body["param"] == "n" and says in caught.value.body["message"]


def test_logit_bias_gives_the_decoders_biased_answer(client, decoder):
    token = decoder.tokenizer(" fox", add_special_tokens=False).input_ids[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                  logit_bias={str(token): 100})
    local = decoder.generate(PROMPT, raw=True, max_new_tokens=5, logit_bias={token: 100.0})[0]
    assert r.choices[0].text == local.text == " fox" * 5  # +100 all but forces it


@pytest.mark.parametrize("bias, says", [({"fox": 1}, "logit_bias has the key 'fox'"),
                                        ({"5": 101}, "a bias must be a number from -100 to 100")])
def test_a_bad_logit_bias_is_a_400_naming_it(client, bias, says):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logit_bias=bias)
    assert caught.value.body["param"] == "logit_bias" and says in caught.value.body["message"]
