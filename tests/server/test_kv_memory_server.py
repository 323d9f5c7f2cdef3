"""``--kv-cache-memory`` over real HTTP with the openai client: a request that could never fit the
KV cache's memory is a 400 naming the request's limit field, in one line, and the server goes on; requests
that fit one at a time all get their answers (they wait for room, never a 429 or a 500), equal to
the decoder's own; the metric reports the fraction of the memory reserved."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from specdraft.server import create_app

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def decoder(smol_tokenizer):
    from specdraft import SpeculativeDecoder
    from specdraft.testing import tiny_llama

    model = tiny_llama(vocab_size=len(smol_tokenizer), seed=5, max_positions=512)
    probe = SpeculativeDecoder(model, smol_tokenizer, drafter="ngram", spec_length=3)
    budget = probe.runner.cache.bytes_for(1, 100)  # one row of about 100 tokens (a 256-token capacity)
    with SpeculativeDecoder(model, smol_tokenizer, drafter="ngram", target_name="tiny", spec_length=3,
                            max_batch=4, kv_cache_memory=budget) as dec:
        yield dec


@pytest.fixture(scope="module")
def served(decoder, serve):
    with serve(create_app(decoder)) as base:
        yield base


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_request_that_could_never_fit_is_a_400_naming_max_tokens(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=400, temperature=0)
    body = caught.value.body
    assert body["param"] == "max_tokens" and "of KV cache" in body["message"] and "\n" not in body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                       max_completion_tokens=400, temperature=0)
    assert caught.value.body["param"] == "max_completion_tokens"  # the field the request gave
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)  # still serving
    assert r.usage.completion_tokens == 8


def test_requests_that_fit_one_at_a_time_all_get_their_answers(client, decoder, served):
    expected = decoder.generate(PROMPT, raw=True, max_new_tokens=20)[0].text
    answers, errors = [], []

    def ask():
        try:
            answers.append(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                                     temperature=0).choices[0].text)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and answers == [expected] * 4
    choices = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, n=3).choices
    assert [c.text for c in choices] == [expected] * 3  # n=3 on memory for one row: one after another
    metrics = httpx.get(f"{served}/metrics").text
    usage = [line for line in metrics.splitlines() if line.startswith("specdraft:kv_cache_usage_perc{")]
    assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0.0  # idle: nothing reserved
