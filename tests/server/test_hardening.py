"""The HTTP layer against a hostile client (issue 32's findings), each reproduced and its fixed
behaviour asserted: a request-body limit and a prompt-length check before tokenizing, JSON only,
lone surrogates and deep nesting, 429's Retry-After, strict types and roles, no field silently
ignored, /tokenize and /detokenize, and what the API key covers.

Most tests run over the fake decoder (conftest.py); those that need a real tokenizer run a tiny
random model with the default model's tokenizer (its vocabulary and chat template).
"""

from __future__ import annotations

import json
import math
import random
import socket
import threading

import httpx
import openai
import pytest

from specdraft.server import create_app

pytestmark = pytest.mark.server


def post(url: str, path: str, body, headers=None, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) or hasattr(body, "__next__") else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})}, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    """The error of a ``status`` response: OpenAI's shape, one line, no traceback."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
    return error


@pytest.fixture
def server(fake_decoder, serve):
    with serve(create_app(fake_decoder)) as url:
        yield url


@pytest.fixture
def small(fake_decoder, serve):
    """A server that reads bodies of at most 1000 bytes."""
    with serve(create_app(fake_decoder, max_request_bytes=1000)) as url:
        yield url


# -- a real tokenizer: a tiny random model with the default model's tokenizer ------------------


class CountingTokenizer:
    """The tokenizer, counting the characters each call is asked to tokenize."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.calls = tokenizer, []

    def __call__(self, text, *args, **kwargs):
        self.calls.append(len(text))
        return self._tokenizer(text, *args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def real_decoder(smol_tokenizer):
    """A context of 256 tokens; ``decoder.tokenizer.calls`` counts what is tokenized."""
    from specdraft import SpeculativeDecoder
    from specdraft.testing import tiny_llama

    model = tiny_llama(vocab_size=len(smol_tokenizer), seed=3, max_positions=256)
    with SpeculativeDecoder(model, CountingTokenizer(smol_tokenizer), drafter="prompt-lookup",
                            target_name="tiny") as decoder:
        yield decoder


@pytest.fixture(scope="module")
def real(real_decoder, serve):
    """The real decoder's server, reading bodies of up to 64 MiB (so the prompt check is what acts)."""
    with serve(create_app(real_decoder, max_request_bytes=64 * 2**20)) as url:
        yield url


# -- 1. the request-body limit and the prompt-length check ------------------------------------


def test_a_body_over_the_limit_is_413(small):
    """A 20 MB body is refused by its Content-Length at once, and a chunked one while it arrives."""
    big = json.dumps({"prompt": "a b c d " * 2500000, "max_tokens": 4})
    error = error_of(post(small, "/v1/completions", big), 413)
    assert "at most 1000 bytes" in error["message"] and "--max-request-bytes" in error["message"]
    assert error["code"] == "request_too_large"
    chunks = (b" " * 100 for _ in range(50))  # no Content-Length: chunked
    assert "more than 1000 bytes" in error_of(post(small, "/v1/completions", chunks), 413)["message"]
    body = {"prompt": "Hi", "max_tokens": 2, "user": "u" * 900}  # within the limit
    assert len(json.dumps(body)) <= 1000 and post(small, "/v1/completions", body).status_code == 200


def raw_exchange(url: str, head: bytes, body: bytes) -> bytes:
    """Send ``head`` and the start of a body, never the rest; the server's answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return answer


def test_the_limit_acts_before_the_body_has_arrived(small):
    """The 413 comes while the client still owes most of the body: nothing waits for (or
    buffers) the whole of it."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 20000000\r\n\r\n")
    assert raw_exchange(small, head, b'{"prompt": "').startswith(b"HTTP/1.1 413")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b'{"prompt": "' + b"a" * 1500
    assert raw_exchange(small, head, b"%x\r\n%s\r\n" % (len(chunk), chunk)).startswith(b"HTTP/1.1 413")


def test_create_app_checks_the_limit(fake_decoder):
    from specdraft.errors import ConfigError
    from specdraft.server.app import DEFAULT_MAX_REQUEST_BYTES

    assert DEFAULT_MAX_REQUEST_BYTES == 8 * 2**20
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ConfigError, match="max_request_bytes"):
            create_app(fake_decoder, max_request_bytes=bad)


def test_a_prompt_too_long_for_the_context_is_refused_untokenized(real, real_decoder):
    """The 20 MB prompt of the finding (here within the body limit): refused by its length alone."""
    calls = real_decoder.tokenizer.calls
    calls.clear()
    huge = "a b c d " * 2500000
    error = error_of(post(real, "/v1/completions", {"prompt": huge, "max_tokens": 4}), 400)
    assert error["param"] == "prompt" and error["message"].startswith("prompt has at least 246914 tokens")
    assert "context holds 256" in error["message"]
    messages = [{"role": "system", "content": "hi"}, {"role": "user", "content": huge}]
    error = error_of(post(real, "/v1/chat/completions", {"messages": messages}), 400)
    assert error["param"] == "messages" and "at least" in error["message"]
    error = error_of(post(real, "/v1/chat/completions", {"messages": messages[:1], "max_tokens": 4,
                                                          "prediction": {"type": "content", "content": huge}}), 400)
    assert error["param"] == "prediction" and "at least" in error["message"]
    assert error_of(post(real, "/tokenize", {"prompt": huge}), 400)["param"] == "prompt"
    assert max(calls, default=0) < 1000  # nothing long was tokenized
    # a prompt the bound lets through, but longer than the context: the decoder's own 400, named
    error = error_of(post(real, "/v1/completions", {"prompt": "one two " * 200, "max_tokens": 4}), 400)
    assert error["param"] == "prompt" and "context holds 256" in error["message"]


def test_the_characters_per_token_bound_is_sound(smol_tokenizer):
    """Every text has at least ceil(characters / bound) tokens; tokenizers whose tokens may swallow
    any amount of text get no bound."""
    from tokenizers import Tokenizer, normalizers
    from transformers import PreTrainedTokenizerFast

    from specdraft.limits import chars_per_token
    from specdraft.testing.models import tiny_tokenizer

    bound = chars_per_token(smol_tokenizer)
    assert bound == max(len(t) for t in smol_tokenizer.get_vocab()) == 81
    rng = random.Random(0)
    alphabet = [" ", "\n", "\t", "#", "-", "=", "a", "é", "的", "🙂", "\u0301", "<|im_start|>", "<|im_end|>"]
    texts = [" " * 5000, "#" * 5000, "\n" * 3000, "<|im_start|>" * 100, "-" * 4000 + "=" * 4000]
    texts += ["".join(rng.choice(alphabet) * rng.randint(1, 200) for _ in range(50)) for _ in range(20)]
    for text in texts:
        assert len(smol_tokenizer(text).input_ids) >= math.ceil(len(text) / bound), text[:40]
    assert chars_per_token(tiny_tokenizer()) is None  # word-level: one <unk> for any word

    def variant(normalizer):
        backend = Tokenizer.from_str(smol_tokenizer.backend_tokenizer.to_str())
        backend.normalizer = normalizer
        return PreTrainedTokenizerFast(tokenizer_object=backend)

    assert chars_per_token(variant(normalizers.NFC())) == 4 * 81  # composition merges up to 4 characters
    assert chars_per_token(variant(normalizers.Strip())) is None
    assert chars_per_token(variant(normalizers.Replace("  ", " "))) == 2 * 81
    assert chars_per_token(variant(normalizers.Replace(" ", ""))) is None


# -- 2. JSON only ------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None,
                                          "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_json_is_415(server, content_type):
    """A web page can send text/plain (or a form) to a keyless localhost server without a CORS
    preflight: such bodies are refused unread."""
    body = b'{"prompt": "Hi", "max_tokens": 2}'
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{server}/v1/completions", content=body, headers=headers)
    if content_type is None:
        assert "content-type" not in r.request.headers
    error = error_of(r, 415)
    assert "Content-Type: application/json" in error["message"] and error["code"] == "unsupported_media_type"


def test_json_with_parameters_is_json(server):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2},
             headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# -- 3. lone surrogates, deep nesting ------------------------------------------------------------


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "abc \ud800 def"}, "prompt"),
    ("/v1/completions", {"prompt": ["abc \udfff"]}, "prompt.0"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", "\ud800"]}, "stop.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc \ud800 def"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user\ud800", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "prediction": {"type": "content", "content": "x\udbff"}}, "prediction.content"),
    ("/v1/completions", {"prompt": "hi", "\ud800": 1}, "\\ud800"),
    ("/tokenize", {"prompt": "abc \ud800"}, "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(real, path, body, param):
    """JSON's "\\ud800" unpaired is a string no tokenizer takes (it was a 500)."""
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as the escape \ud800
    assert "\\ud" in raw
    error = error_of(post(real, path, raw), 400)
    assert error["param"] == param and "lone surrogate" in error["message"], error


def test_an_encoded_surrogate_is_not_utf8(server):
    """A surrogate encoded in the body's bytes (CESU-8) is not UTF-8: refused like any bad byte."""
    r = post(server, "/v1/completions", b'{"prompt": "abc \xed\xa0\x80 def"}')
    assert "not UTF-8 text (byte 16)" in error_of(r, 400)["message"]
    r = post(server, "/v1/completions", '{"prompt": "\ufeff", "max_tokens": 2}'.encode("utf-16"))
    assert "not UTF-8 text" in error_of(r, 400)["message"]


def test_a_surrogate_pair_is_text(server, fake_decoder):
    r = post(server, "/v1/completions", json.dumps({"prompt": "smile \ud83d\ude42", "max_tokens": 2}))
    assert r.status_code == 200 and fake_decoder.calls[-1]["prompt_ids"] == list("smile 🙂".encode())


def test_deep_nesting_is_a_400(server):
    """JSON nested 100000 deep was a RecursionError (500); more than 64 levels are refused."""
    r = post(server, "/v1/completions", '{"prompt": "hi", "metadata": ' + "[" * 100000 + "]" * 100000 + "}")
    assert "nests arrays and objects more than 64 levels" in error_of(r, 400)["message"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    deep = json.loads("[" * 70 + "]" * 70)  # within the JSON parser's reach, deeper than 64
    assert "64 levels" in error_of(post(server, "/v1/chat/completions",
                                        {**body, "chat_template_kwargs": {"x": deep}}), 400)["message"]
    fine = json.loads("[" * 30 + "]" * 30)
    r = post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"x": fine}})
    assert r.status_code == 200, r.text


# -- 4. 429 -----------------------------------------------------------------------------------


def test_the_schedulers_queue_full_message_does_not_contradict_itself():
    """It said "3 requests are waiting (at most 2)": it counted a request a free slot was about to take."""
    from specdraft.engine.scheduler import Scheduler
    from specdraft.errors import QueueFull

    scheduler = Scheduler(max_batch=1, max_waiting=2)
    scheduler.add([object(), object(), object()])  # one takes the free slot at the next step
    with pytest.raises(QueueFull) as caught:
        scheduler.add([object()])
    assert str(caught.value) == "the server is busy: its queue of 2 waiting requests is full; retry later"


def test_a_request_of_more_choices_than_the_queue_holds_is_served_when_nothing_else_waits():
    """``n`` up to its documented 128 on an idle server: it got 429 forever when n exceeded
    --max-waiting + --max-batch (issue 47); behind other waiting requests it still gets 429."""
    from specdraft.engine.scheduler import Scheduler
    from specdraft.errors import QueueFull

    scheduler = Scheduler(max_batch=8, max_waiting=64)
    scheduler.add([object()] * 128)  # idle: in, whatever its size
    with pytest.raises(QueueFull):
        scheduler.add([object()])  # 120 wait beyond the free slots now
    busy = Scheduler(max_batch=1, max_waiting=2)
    busy.add([object()] * 2)  # one takes the slot, one waits
    with pytest.raises(QueueFull):
        busy.add([object()] * 3)


@pytest.mark.parametrize("body, says", [
    ('{"prompt": "Hi", "max_tokens": 1' + "0" * 5000 + "}", "a number of more than 4300 digits"),
    ('{"prompt": "Hi", "temperature": NaN}', "NaN is not a JSON number"),
    ('{"prompt": "Hi", "top_p": Infinity}', "Infinity is not a JSON number"),
    ('{"prompt": "Hi", "logit_bias": {"5": -Infinity}}', "-Infinity is not a JSON number"),
])
def test_numbers_json_does_not_have_are_400s(server, body, says):
    """A 5,000-digit integer was a 500 (Python's int conversion limit); NaN and Infinity, which
    Python's json reads and JSON does not have, reached the settings."""
    assert says in error_of(post(server, "/v1/completions", body), 400)["message"]


# -- 5. strict types, roles, param on every 400 -------------------------------------------------


@pytest.mark.parametrize("content, param", [
    ([{"type": "text", "text": "x", "image_url": "y"}], "prediction.content.0.image_url"),
    ([{"type": "text"}], "prediction.content.0.text"),
    (5, "prediction.content"),
])
def test_param_names_the_field_as_the_client_wrote_it(server, content, param):
    """It read ``prediction.content.list[TextPart].0.image_url``: pydantic's label of the union
    member it tried, which no client writes (issue 47)."""
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                               "prediction": {"type": "content", "content": content}})
    error = error_of(r, 400)
    assert error["param"] == param and "[" not in error["message"].split(":")[0], error


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "max_tokens": True}, "max_tokens"),  # was 1
    ({"prompt": "Hi", "max_tokens": 2.0}, "max_tokens"),
    ({"prompt": "Hi", "stream": "yes"}, "stream"),  # was true
    ({"prompt": "Hi", "stream": 1}, "stream"),
    ({"prompt": "Hi", "temperature": "0.5"}, "temperature"),
    ({"prompt": "Hi", "temperature": True}, "temperature"),
    ({"prompt": "Hi", "seed": "7"}, "seed"),
    ({"prompt": "Hi", "seed": -1}, "seed"),
    ({"prompt": "Hi", "n": True}, "n"),
    ({"prompt": "Hi", "stop": 5}, "stop"),
    ({"prompt": "Hi", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": "Hi", "temperature": -1}, "temperature"),  # the sampling ranges: param was null
    ({"prompt": "Hi", "temperature": 0.00001}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "top_k": -2}, "top_k"),
    ({"prompt": "Hi", "min_p": 2}, "min_p"),
    ({"prompt": "Hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "Hi", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
])
def test_strict_types_and_ranges_name_the_parameter(server, fake_decoder, body, param):
    error = error_of(post(server, "/v1/completions", body), 400)
    assert error["param"] == param and param.split(".")[-1] in error["message"], error
    assert not fake_decoder.calls  # refused before the decoder


def test_floats_take_integers_and_stop_strings_are_checked(server, real, fake_decoder):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_p": 1})
    assert r.status_code == 200 and fake_decoder.calls[-1]["temperature"] == 1.0
    error = error_of(post(real, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": [""]}), 400)
    assert error["param"] == "stop" and "non-empty" in error["message"]


@pytest.mark.parametrize("message, param, says", [
    ({"role": "xyz", "content": "hi"}, "messages.0.role", "unknown role 'xyz'"),
    ({"role": "tool", "content": "hi"}, "messages.0.tool_call_id", "needs tool_call_id"),
    ({"role": "user", "content": "hi", "tool_call_id": "call_1"}, "messages.0.tool_call_id", "only a tool message"),
    ({"role": "function", "content": "hi", "name": "f"}, "messages.0.role", "send tool messages"),
    ({"role": "user", "content": "hi", "tool_calls": [{"id": "c"}]}, "messages.0.tool_calls", "only an assistant's"),
    ({"role": "user", "content": None}, "messages.0.content", "needs content"),
    ({"role": "system"}, "messages.0.content", "needs content"),
    ({"role": "user", "content": 5}, "messages.0.content", "content"),
    ({"role": "assistant", "content": "x", "tool_calls": [{"id": "c", "type": "function"}]},
     "messages.0.tool_calls.0", "a tool call must be"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}, "messages.0.tool_calls.0.function.arguments", "not valid JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": '{"a": NaN}'}}]}, "messages.0.tool_calls.0.function.arguments", "NaN is not JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
     "messages.0.tool_calls.0", "a tool call must be"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "bogus", "function": {"name": "f"}}]},
     "messages.0.tool_calls.0", "a tool call must be"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "x": 1}}]},
     "messages.0.tool_calls.0.function.x", "unknown key"),
    ({"role": "assistant", "content": None, "refusal": "no"}, "messages.0.refusal", "not supported"),
    ({"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
     "messages.0.content.0.cache_control", "unknown parameter"),
])
def test_roles_and_content_are_checked(server, message, param, says):
    body = {"messages": [{"role": "user", "content": "first"}, message], "max_tokens": 2}
    error = error_of(post(server, "/v1/chat/completions", body), 400)
    param = param.replace("messages.0", "messages.1")
    assert error["param"] == param and says in error["message"], error


def test_an_assistant_message_echoed_back_is_accepted(server, fake_decoder):
    """What the openai client sends back of a response's message (refusal and tool_calls null),
    and an assistant message with null content."""
    messages = [{"role": "developer", "content": "B"}, {"role": "user", "content": "H", "name": "ann"},
                {"role": "assistant", "content": "O", "refusal": None, "tool_calls": None, "function_call": None},
                {"role": "assistant", "content": None}, {"role": "user", "content": "A"}]
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert bytes(fake_decoder.calls[-1]["prompt_ids"]) == b"system: B\nuser: H\nassistant: O\nassistant: \nuser: A\n"


# -- 6. nothing silently ignored ----------------------------------------------------------------


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"some_new_openai_field": True}, "some_new_openai_field"),
    ("/v1/completions", {"best_of": 1, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("/v1/chat/completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("/v1/chat/completions", {"stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x", "extra": 1}}, "prediction.extra"),
])
def test_an_unknown_parameter_is_a_400(server, path, extra, param):
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    error = error_of(post(server, path, {**body, **extra}), 400)
    assert error["param"] == param and error["code"] == "unknown_parameter"
    assert error["message"].startswith(f"unknown parameter {param!r}")


def test_an_unknown_field_of_a_message_is_a_400(server):
    messages = [{"role": "assistant", "content": "x", "reasoning_content": "hmm"}]
    error = error_of(post(server, "/v1/chat/completions", {"messages": messages}), 400)
    assert error["param"] == "messages.0.reasoning_content" and error["code"] == "unknown_parameter"


def test_fields_without_effect_are_accepted_and_change_nothing(server, fake_decoder):
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    plain = post(server, "/v1/chat/completions", base).json()
    extras = {"user": "u-1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
              "parallel_tool_calls": True, "modalities": ["text"], "prompt_cache_key": "k",
              "safety_identifier": "s", "stream_options": None, "logit_bias": {}, "tool_choice": "none",
              "response_format": {"type": "text"}, "logprobs": False, "n": 1}
    r = post(server, "/v1/chat/completions", {**base, **extras})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain["choices"] and fake_decoder.calls[-1] == fake_decoder.calls[-2]
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "user": "u-1", "safety_identifier": "s"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra, param", [
    ({"modalities": ["text", "audio"]}, "modalities.1"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"metadata": {"k": 1}}, "metadata.k"),
])
def test_fields_that_would_change_the_output_are_refused(server, extra, param):
    body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
    assert error_of(post(server, "/v1/chat/completions", body), 400)["param"] == param


def test_chat_template_kwargs_reach_the_template(server, fake_decoder, real, real_decoder):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and fake_decoder.template_kwargs == {"enable_thinking": False}
    error = error_of(post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": ["x"]}), 400)
    assert error["param"] == "chat_template_kwargs"
    # on the real template: add_generation_prompt=false leaves out the assistant's turn
    messages, without_turn = body["messages"], {"add_generation_prompt": False}
    ids = real_decoder.encode_chat(messages)
    assert ids == real_decoder.encode_chat(messages, {}) != real_decoder.encode_chat(messages, without_turn)
    r = post(real, "/v1/chat/completions", {**body, "chat_template_kwargs": without_turn})
    assert r.json()["usage"]["prompt_tokens"] == len(real_decoder.encode_chat(messages, without_turn))
    error = error_of(post(real, "/v1/chat/completions", {**body, "chat_template_kwargs": {"tokenize": True}}), 400)
    assert error["param"] == "chat_template_kwargs" and "tokenize" in error["message"]


# -- 7. /tokenize, /detokenize, prompt_tokens_details -----------------------------------------


def test_tokenize_and_detokenize(real, real_decoder, smol_tokenizer):
    text = "The days of the week are Monday, Tuesday,"
    r = post(real, "/tokenize", {"prompt": text}).json()
    assert r == {"tokens": smol_tokenizer(text).input_ids, "count": len(r["tokens"]), "max_model_len": 256}
    r = post(real, "/tokenize", {"prompt": text, "add_special_tokens": False, "model": "tiny"}).json()
    assert r["tokens"] == smol_tokenizer(text, add_special_tokens=False).input_ids
    messages = [{"role": "user", "content": text}]
    r = post(real, "/tokenize", {"messages": messages}).json()
    assert r["tokens"] == real_decoder.encode_chat(messages) and r["count"] == len(r["tokens"])
    shorter = post(real, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert shorter["tokens"] == real_decoder.encode_chat(messages, {"add_generation_prompt": False})
    assert shorter["count"] < r["count"]
    assert post(real, "/detokenize", {"tokens": smol_tokenizer(text).input_ids}).json() == {"prompt": text}
    assert post(real, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, param", [
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
    ("/detokenize", {}, 400, "tokens"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "return_token_strs"),
    ("/tokenize", {"messages": [{"role": "xyz", "content": "x"}]}, 400, "messages.0.role"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
])
def test_bad_tokenize_requests(real, path, body, status, param):
    assert error_of(post(real, path, body), status)["param"] == param


def test_usage_has_prompt_tokens_details(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    r = client.completions.create(model="fake-model", prompt="Hi", max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.to_dict()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    chunks = list(client.completions.create(model="fake-model", prompt="Hi", max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(real, real_decoder, smol_tokenizer):
    """vLLM's truncate_prompt_tokens through the openai client: the answer is the cut prompt's, usage
    counts the tokens kept, and a prompt longer than the context is taken once cut."""
    client = openai.OpenAI(base_url=f"{real}/v1", api_key="x", max_retries=0)
    text = "The days of the week are Monday, Tuesday, Wednesday, Thursday,"
    tail = smol_tokenizer(text).input_ids[-6:]
    settings = dict(model="tiny", max_tokens=5, temperature=0)
    cut = client.completions.create(prompt=text, extra_body={"truncate_prompt_tokens": 6}, **settings)
    whole = client.completions.create(prompt=tail, **settings)
    assert cut.choices[0].text == whole.choices[0].text and cut.usage.prompt_tokens == 6
    huge = text * 60  # about 900 tokens: more than the context (256) holds
    assert error_of(post(real, "/v1/completions", {"prompt": huge, **settings}), 400)["param"] == "prompt"
    r = client.completions.create(prompt=huge, extra_body={"truncate_prompt_tokens": 100}, **settings)
    assert r.usage.prompt_tokens == 100 and r.choices[0].finish_reason == "length"
    error = error_of(post(real, "/v1/completions", {"prompt": text, "truncate_prompt_tokens": 0, **settings}), 400)
    assert error["param"] == "truncate_prompt_tokens" and "integer >= 1" in error["message"]


# -- 8. HEAD /health; what the API key covers ------------------------------------------------------


def test_head_health(server):
    r = httpx.head(f"{server}/health")
    assert r.status_code == 200 and r.content == b""


def test_the_api_key_covers_everything_but_health_and_metrics(fake_decoder, serve):
    with serve(create_app(fake_decoder, api_key="sesame")) as url:
        for method, path in [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("POST", "/tokenize"),
                             ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/nowhere")]:
            r = httpx.request(method, f"{url}{path}", json={"tokens": [1]})
            assert error_of(r, 401)["code"] == "invalid_api_key", path
        key = {"Authorization": "Bearer sesame"}
        assert httpx.get(f"{url}/openapi.json", headers=key).json()["info"]["title"] == "specdraft"
        assert httpx.get(f"{url}/docs", headers=key).status_code == 200
        assert "/tokenize" in httpx.get(f"{url}/openapi.json", headers=key).json()["paths"]
        for method in ("GET", "HEAD"):
            assert httpx.request(method, f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200


# -- a fuzz of request bodies: no 500 ------------------------------------------------------------

#: values a careless or hostile client puts anywhere
_ODD = [None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 10**40, 0.5, -0.0, 1e308, -1e308, 1e-320, "", "x",
        "5", "\u0000", "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), "🙂" * 50, [], [None],
        [1, "a"], {}, {"a": 1}, [[[]]], {"type": "text"}, {"type": "json_schema"}, ["<|im_end|>"], {"5": 1e308}]
_FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
           "n", "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "logit_bias",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
           "stop_token_ids", "response_format", "prediction", "user", "echo", "best_of", "tools", "model",
           "guided_choice", "guided_regex", "structured_outputs", "truncate_prompt_tokens", "chat_template_kwargs"]


def _fuzzed_bodies(rng: random.Random, count: int):
    base = {"/v1/completions": {"prompt": "Hi", "max_tokens": 3},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}}
    for _ in range(count):
        path = rng.choice(list(base))
        body = json.loads(json.dumps(base[path]))
        for _ in range(rng.randint(1, 4)):
            field = rng.choice(_FIELDS)
            if field == "messages" and rng.random() < 0.5:  # a message with odd parts
                body[field] = [{"role": rng.choice(["user", "system", "assistant", "tool", 7, None]),
                                "content": rng.choice(_ODD + [[{"type": "text", "text": rng.choice(_ODD)}]])}]
            else:
                body[field] = rng.choice(_ODD)
        yield path, body


def test_fuzzed_bodies_get_no_500(server):
    """300 bodies of valid shape with fields set to odd values (huge and tiny numbers, wrong types,
    empty and nested containers, special-token text), seeded: each answer is a 200 or an error the
    client caused (4xx), never a 500."""
    rng = random.Random(47)
    with httpx.Client(timeout=60) as client:
        for path, body in _fuzzed_bodies(rng, 300):
            r = client.post(f"{server}{path}", content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code < 500, (path, body, r.text)
            if r.status_code != 200:
                error_of(r, r.status_code)
