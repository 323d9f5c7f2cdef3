"""``logprobs`` over HTTP with the official ``openai`` client: chat's ``logprobs`` + ``top_logprobs``
and completions' ``logprobs``, whole and streamed, in OpenAI's shapes, with the engine's numbers.

The target is a tiny random Llama with the default model's real tokenizer (byte-level BPE, chat
template), its output head cut down to a few tokens, some of them parts of multi-byte characters,
so that streamed text is held back for incomplete characters (and for a stop string that never
comes): each chunk carries the logprobs of the tokens its text completes, and the chunks add up
to the whole answer's. The engine's exactness itself: tests/engine/test_logprobs.py.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from specdraft import SpeculativeDecoder
from specdraft.server import create_app
from specdraft.testing import tiny_llama

pytestmark = pytest.mark.server

TEXT = "héllo 日本 naïve café 😀 ok, done."
MESSAGES = [{"role": "user", "content": "Say something."}]
STOP = ["qqq"]  # never generated (q is not among the tokens): its first two characters are held back


@pytest.fixture(scope="module")
def decoder(smol_tokenizer):
    """Its head gives logits only to the tokens of ``TEXT``: the rest stay at 0, far below."""
    tokenizer = smol_tokenizer
    model = tiny_llama(vocab_size=len(tokenizer), seed=3, max_positions=512, dtype=torch.float32)
    keep = sorted(set(tokenizer(TEXT, add_special_tokens=False).input_ids))
    with torch.no_grad():
        rows = torch.randn((len(keep), model.config.hidden_size), generator=torch.Generator().manual_seed(0)) * 3
        model.lm_head.weight.zero_()
        model.lm_head.weight[keep] = rows
    with SpeculativeDecoder(model, tokenizer, drafter="ngram", spec_length=4) as dec:
        yield dec


@pytest.fixture(scope="module")
def served(decoder, serve):
    with serve(create_app(decoder, model_name="tiny")) as url:
        yield url


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def client(served):
    return _client(served)


SETTINGS = dict(model="tiny", max_tokens=16, temperature=1.0, seed=5, stop=STOP, frequency_penalty=0.3)


def _engine_logprobs(decoder, prompt_ids, top, mode):
    """The Python API's answer for the same request."""
    sampling = {k: v for k, v in SETTINGS.items() if k not in ("model", "max_tokens")}
    [result] = decoder.generate_ids([prompt_ids], max_new_tokens=SETTINGS["max_tokens"], logprobs=top,
                                   logprobs_mode=mode, **sampling)
    return result


def _check_entry(decoder, entry_token, entry_logprob, entry_bytes, expected):
    piece = decoder.tokenizer.convert_ids_to_tokens(expected.token_id)
    assert bytes(entry_bytes) == _byte_level(piece) and entry_logprob == expected.logprob
    assert entry_token == bytes(entry_bytes).decode("utf-8", errors="replace")


def _byte_level(piece: str) -> bytes:
    from specdraft.server.logprobs import _bytes_to_unicode

    return bytes({c: b for b, c in _bytes_to_unicode().items()}[c] for c in piece)


def _released_text(entries) -> str:
    return b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")


def test_chat_logprobs_whole_and_streamed(client, decoder):
    whole = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **SETTINGS)
    choice = whole.choices[0]
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens > 8
    expected = _engine_logprobs(decoder, decoder.encode_chat(MESSAGES), 3, "processed")
    assert choice.message.content == expected.text and len(content) == len(expected.logprobs)
    for entry, want in zip(content, expected.logprobs):
        _check_entry(decoder, entry.token, entry.logprob, entry.bytes, want)
        assert len(entry.top_logprobs) == 3
        for top, (token_id, logprob) in zip(entry.top_logprobs, want.top):
            _check_entry(decoder, top.token, top.logprob, top.bytes, type(want)(token_id, logprob))
    assert any("\ufffd" in e.token for e in content)  # tokens that are parts of characters

    chunks = list(client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True,
                                                 **SETTINGS))
    text, released, held = "", [], 0
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta, logprobs = chunk.choices[0].delta, chunk.choices[0].logprobs
        text += delta.content or ""
        released += logprobs.content if logprobs is not None else []
        if chunk.choices[0].finish_reason is None and delta.content:  # the tokens its text completes
            assert text.startswith(_released_text(released)) and not _released_text(released).endswith("\ufffd")
            held += _released_text(released) != text
    assert text == choice.message.content
    assert [e.model_dump() for e in released] == [e.model_dump() for e in content]
    assert held  # some chunk's text ended inside a token, whose logprob waited for the next chunk


def test_completion_logprobs_whole_and_streamed(client, decoder):
    prompt = "Hello there"
    whole = client.completions.create(prompt=prompt, logprobs=2, **SETTINGS)
    logprobs = whole.choices[0].logprobs
    expected = _engine_logprobs(decoder, decoder.encode(prompt, raw=True), 2, "processed")
    texts = [bytes(_byte_level(decoder.tokenizer.convert_ids_to_tokens(e.token_id))).decode("utf-8", "replace")
             for e in expected.logprobs]
    assert logprobs.tokens == texts and logprobs.token_logprobs == [e.logprob for e in expected.logprobs]
    assert logprobs.text_offset == [sum(map(len, texts[:i])) for i in range(len(texts))]
    text_of = {e.token_id: t for e, t in zip(expected.logprobs, texts)}
    for top, token, want in zip(logprobs.top_logprobs, texts, expected.logprobs):
        best = {bytes(_byte_level(decoder.tokenizer.convert_ids_to_tokens(i))).decode("utf-8", "replace"): v
                for i, v in want.top}
        assert top == {**best, token: best.get(token, want.logprob)}  # the top 2, and the token itself
        assert text_of[want.token_id] == token

    chunks = list(client.completions.create(prompt=prompt, logprobs=2, stream=True, **SETTINGS))
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in joined.items():
                values += getattr(chunk.choices[0].logprobs, key)
    assert joined == logprobs.model_dump()
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_a_server_in_raw_mode_returns_the_models_own(decoder, serve):
    """``create_app(logprobs_mode="raw")`` (``serve --logprobs-mode raw``): log-softmax of the
    model's logits, whatever the request's sampling settings."""
    with serve(create_app(decoder, model_name="tiny", logprobs_mode="raw")) as url:
        whole = _client(url).chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **SETTINGS)
    expected = _engine_logprobs(decoder, decoder.encode_chat(MESSAGES), 2, "raw")
    processed = _engine_logprobs(decoder, decoder.encode_chat(MESSAGES), 2, "processed")
    got = whole.choices[0].logprobs.content
    assert [e.logprob for e in got] == [e.logprob for e in expected.logprobs] != \
        [e.logprob for e in processed.logprobs]
    assert [[t.logprob for t in e.top_logprobs] for e in got] == [[v for _, v in e.top] for e in expected.logprobs]


def test_answers_without_logprobs_have_none(client):
    whole = client.chat.completions.create(messages=MESSAGES, **SETTINGS)
    assert whole.choices[0].logprobs is None
    chunks = list(client.completions.create(prompt="Hi", stream=True, **SETTINGS))
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 3}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": True}, "logprobs"),
])
def test_out_of_range_logprobs_are_400_naming_the_field(served, path, body, param):
    r = httpx.post(f"{served}{path}", json={"max_tokens": 2, **body}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and "\n" not in error["message"], error


def test_serve_refuses_an_unknown_logprobs_mode(capsys):
    from specdraft.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--logprobs-mode", "logits"])
    assert info.value.code == 2 and "argument --logprobs-mode: invalid choice: 'logits'" in capsys.readouterr().err
