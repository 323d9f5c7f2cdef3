"""The HTTP layer over a fake decoder (see conftest.py): OpenAI's shapes, streaming, errors,
authentication, metrics and freeing a request whose client went away. Milliseconds per test."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdraft.server import create_app

pytestmark = pytest.mark.server


@pytest.fixture
def server(fake_decoder, serve):
    with serve(create_app(fake_decoder)) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=30)


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
    return error


def test_models_and_health(server):
    models = httpx.get(f"{server}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model"] and models["object"] == "list"
    assert models["data"][0]["max_model_len"] == 64
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_served_model_name_replaces_the_targets(fake_decoder, serve):
    with serve(create_app(fake_decoder, model_name="mine")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["mine"]
        assert client.completions.create(model="mine", prompt="hi", max_tokens=2).model == "mine"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="fake-model", prompt="hi", max_tokens=2)


def test_completion_defaults_and_response_shape(client, fake_decoder):
    r = client.completions.create(model="fake-model", prompt="Hello")
    call = fake_decoder.calls[-1]
    assert call["prompt_ids"] == list(b"Hello")  # raw: no chat template
    assert call["max_new_tokens"] == 16 and call["temperature"] == 1.0  # OpenAI's defaults
    assert (call["top_p"], call["top_k"], call["min_p"], call["seed"]) == (1.0, 0, 0.0, None)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == "".join(f" t{100 + (5 + i) % 50}" for i in range(16))
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 16, 21)
    spec = r.model_extra["spec_decode"]
    assert spec == {"drafted_tokens": 16, "accepted_tokens": 10, "acceptance_rate": 10 / 16,
                    "tokens_per_target_pass": 16 / 6, "drafts": 5, "target_passes": 6}


@pytest.mark.parametrize("prompt", [[72, 105], ["Hi"], "Hi"])
def test_completion_prompt_forms(client, fake_decoder, prompt):
    client.completions.create(model="fake-model", prompt=prompt, max_tokens=2, temperature=0)
    assert fake_decoder.calls[-1]["prompt_ids"] == [72, 105]


def test_settings_reach_the_decoder(client, fake_decoder):
    r = client.completions.create(model="fake-model", prompt="Hello", max_tokens=30, temperature=0.5, top_p=0.9,
                                  seed=7, stop=[" t115"], presence_penalty=0.5, frequency_penalty=0.25,
                                  extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2})
    call = fake_decoder.calls[-1]
    assert {k: call[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                 "presence_penalty", "frequency_penalty", "repetition_penalty")} == {
        "max_new_tokens": 30, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7,
        "stop": [" t115"], "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.2}
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text.endswith("t114")


def test_streamed_completion_equals_the_whole_one(client):
    whole = client.completions.create(model="fake-model", prompt="Hello", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="fake-model", prompt="Hello", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.choices[0].text for c in chunks[:-2])  # no empty bursts before the finish chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10  # OpenAI's usage chunk
    assert chunks[-1].model_extra["spec_decode"]["drafted_tokens"] == 10
    assert chunks[-2].model_extra["spec_decode"]["drafted_tokens"] == 10  # the finish chunk has it too


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model="fake-model", prompt="Hello", max_tokens=4, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_chat_completion_and_its_stream(client, fake_decoder):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    r = client.chat.completions.create(model="fake-model", messages=messages, temperature=0)
    prompt = b"system: Be brief.\nuser: Hi\nthere\n"
    assert fake_decoder.calls[-1]["prompt_ids"] == list(prompt)
    # chat's default max_tokens: what the context holds, at most 1024
    assert fake_decoder.calls[-1]["max_new_tokens"] == 64 - len(prompt)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 64 - len(prompt)
    chunks = list(client.chat.completions.create(model="fake-model", messages=messages, temperature=0,
                                                 max_completion_tokens=7, stream=True))
    assert fake_decoder.calls[-1]["max_new_tokens"] == 7
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content[:35]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].delta.content is None


def raw_post(url: str, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json",
                                                                **(headers or {})}, timeout=30)


@pytest.mark.parametrize("body, status, param, says", [
    ({"prompt": "Hi", "temperature": -1}, 400, "temperature", "temperature"),  # the sampling ranges
    ({"prompt": "Hi", "temperature": "hot"}, 400, "temperature", "temperature"),  # the request's types
    ({"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "Hi", "max_tokens": 100}, 400, "max_tokens", "context holds 64 tokens"),
    ({"prompt": "Hi", "n": 129}, 400, "n", "less than or equal to 128"),
    ({"prompt": "Hi", "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ({"prompt": "Hi", "logprobs": 2}, 400, "logprobs", "no tokenizer"),  # the fake decoder has none
    ({"prompt": "Hi", "echo": True}, 400, "echo", "not supported"),
    ({"prompt": "Hi", "best_of": 3}, 400, "best_of", "not supported"),
    ({"prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ({"prompt": [[1, 2]]}, 400, "prompt", "list of token ids"),
    ({"prompt": "  "}, 400, "prompt", "empty"),
    ({}, 400, "prompt", "no prompt"),
    ({"prompt": "x" * 80}, 400, "prompt", "context holds 64"),  # longer than the context: the decoder says so
    ({"prompt": "Hi", "some_new_openai_field": True}, 400, "some_new_openai_field", "unknown parameter"),
    ({"prompt": "Hi", "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
])
def test_bad_completion_requests(server, body, status, param, says):
    r = raw_post(server, "/v1/completions", body)
    error = error_of(r)
    assert r.status_code == status and says in error["message"] and error["param"] == param, error


@pytest.mark.parametrize("body, param, says", [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role", "Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content",
     "only text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools", "a tool must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "response_format", "response_format.type: must be one of"),  # structured output: test_structured_server.py
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500}, "max_completion_tokens",
     "context holds"),
])
def test_bad_chat_requests(server, body, param, says):
    r = raw_post(server, "/v1/chat/completions", body)
    error = error_of(r)
    assert r.status_code == 400 and says in error["message"] and error["param"] == param, error


def test_not_json_unknown_paths_and_methods(server):
    for body, says in [(b"{not json", "not valid JSON"), (b"", "empty"), (b"[1]", "JSON object")]:
        r = raw_post(server, "/v1/completions", body)
        assert r.status_code == 400 and says in error_of(r)["message"], body
    r = httpx.get(f"{server}/v1/engines")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    r = httpx.get(f"{server}/v1/completions")
    assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"


def test_openai_client_sees_the_errors(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="fake-model", prompt="Hi", n=0)
    assert caught.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_api_key(fake_decoder, serve):
    with serve(create_app(fake_decoder, api_key="sesame")) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = raw_post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers)
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        r = httpx.get(f"{url}/v1/models")
        assert r.status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model="fake-model", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_queue_full_is_429_and_the_queue_drains(serve, wait_for, make_fake_decoder):
    decoder = make_fake_decoder(max_batch=1, max_waiting=1)
    decoder.bursts = threading.Semaphore(0)  # no burst: the first request runs until it is closed
    with serve(create_app(decoder)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        first = client.completions.create(model="fake-model", prompt="Hi", max_tokens=50, stream=True)
        second = client.completions.create(model="fake-model", prompt="Hi", max_tokens=50, stream=True)
        assert (decoder.num_running, decoder.num_waiting) == (1, 1)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model="fake-model", prompt="Hi", max_tokens=2)
        assert caught.value.status_code == 429 and caught.value.body["code"] == "queue_full"
        assert caught.value.response.headers["retry-after"] == "1"  # seconds
        first.close()
        second.close()
        assert wait_for(lambda: decoder.num_running + decoder.num_waiting == 0)
        decoder.bursts = None
        assert client.completions.create(model="fake-model", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_drafter_error_is_500_and_the_server_goes_on(client, fake_decoder, server):
    fake_decoder.fail = True
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="fake-model", prompt="Hi", max_tokens=4)
    assert "fake-drafter" in caught.value.body["message"] and caught.value.body["code"] == "drafter_error"
    fake_decoder.fail = True  # after the stream started: one error event, then [DONE]
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "fake-drafter" in error["message"] and error["type"] == "server_error"
    with pytest.raises(openai.APIError, match="fake-drafter"):  # the openai client raises it
        fake_decoder.fail = True
        list(client.completions.create(model="fake-model", prompt="Hi", max_tokens=4, stream=True))
    assert client.completions.create(model="fake-model", prompt="Hi", max_tokens=4).usage.completion_tokens == 4


def test_unexpected_error_is_a_one_line_500_and_logged(client, fake_decoder, monkeypatch, caplog):
    def broken(prompt, raw=False):
        raise RuntimeError("vocab file missing\nsecond line")

    monkeypatch.setattr(fake_decoder, "encode", broken)
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="fake-model", prompt="Hi", max_tokens=4)
    assert caught.value.body["message"] == "internal error: RuntimeError: vocab file missing (logged by the server)"
    monkeypatch.undo()
    assert [r.exc_info[0] for r in caplog.records if r.name == "specdraft.server"] == [RuntimeError]
    assert client.completions.create(model="fake-model", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_a_closed_stream_frees_its_sequence(client, fake_decoder, wait_for):
    fake_decoder.bursts = threading.Semaphore(1)  # one burst, then it runs until it is closed
    stream = client.completions.create(model="fake-model", prompt="Hi", max_tokens=60, stream=True)
    next(iter(stream))
    assert fake_decoder.num_running == 1
    stream.close()
    assert wait_for(lambda: fake_decoder.num_running == 0)
    assert fake_decoder.closed == 1


def test_a_client_leaving_a_whole_request_frees_its_sequence(server, fake_decoder, wait_for):
    """A non-streamed request whose client hangs up once the decoder has it (a raw socket: the
    client leaves on an event, not after a timeout that a slow machine could outlast)."""
    fake_decoder.bursts = threading.Semaphore(0)  # no burst: it runs until it is closed
    body = json.dumps({"prompt": "Hi", "max_tokens": 60}).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        assert fake_decoder.arrived.wait(30) and fake_decoder.num_running == 1
    assert wait_for(lambda: fake_decoder.num_running == 0)
    assert fake_decoder.closed == 1 and fake_decoder.calls[-1]["max_new_tokens"] == 60


def test_metrics_move(client, server, fake_decoder):
    def scrape() -> dict[str, float]:
        """``name{label="value",...}`` (model_name left out) -> value, from the Prometheus text."""
        values = {}
        for family in text_string_to_metric_families(httpx.get(f"{server}/metrics").text):
            for sample in family.samples:
                assert sample.labels.pop("model_name") == "fake-model"
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values

    before = scrape()
    assert before["specdraft:num_requests_running"] == 0 and before["specdraft:num_requests_waiting"] == 0
    client.completions.create(model="fake-model", prompt="Hello", max_tokens=9)
    list(client.completions.create(model="fake-model", prompt="Hello", max_tokens=3, stream=True, stop=" t107"))
    raw_post(server, "/v1/completions", {"prompt": "Hi", "n": 0})
    after = scrape()

    def moved(name):
        return after.get(name, 0) - before.get(name, 0)

    # the fake's stats: every token drafted, 2 of each 3 accepted, per position 2 and 1 of 3 and 2
    assert moved("specdraft:prompt_tokens_total") == 10 and moved("specdraft:generation_tokens_total") == 9 + 3
    assert moved("specdraft:spec_decode_num_draft_tokens_total") == 12
    assert moved("specdraft:spec_decode_num_accepted_tokens_total") == 6 + 2
    assert moved("specdraft:spec_decode_num_drafts_total") == 3 + 1
    assert moved('specdraft:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') == 4
    assert moved('specdraft:request_success_total{finished_reason="length"}') == 1
    assert moved('specdraft:request_success_total{finished_reason="stop"}') == 1
    assert moved('specdraft:request_errors_total{status="400"}') == 1
    assert moved("specdraft:e2e_request_latency_seconds_count") == 2
    assert moved("specdraft:time_to_first_token_seconds_count") == 2


def test_each_app_counts_alone(fake_decoder):
    one, two = create_app(fake_decoder), create_app(fake_decoder)
    assert one.state.metrics.registry is not two.state.metrics.registry


def test_concurrent_streams_each_get_their_own_text(client, fake_decoder):
    fake_decoder.max_waiting = None
    out: dict[int, str] = {}

    def run(i: int) -> None:
        chunks = client.completions.create(model="fake-model", prompt="x" * (i + 1), max_tokens=5 + i, stream=True)
        out[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {i: "".join(f" t{100 + (i + 1 + j) % 50}" for j in range(5 + i)) for i in range(10)}


def test_json_only(server):
    """``curl -d`` sends application/x-www-form-urlencoded unless told otherwise: refused (415),
    as a web page's form or text/plain post to a keyless server is (test_hardening.py has more)."""
    r = httpx.post(f"{server}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "Content-Type: application/json" in error_of(r)["message"]


def test_serve_without_the_extra_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    from specdraft.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else find_spec(name, *a))
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'specdraft[serve]'" in err and "uvicorn" in err


@pytest.mark.parametrize("args, says", [
    (["--spec-length", "0"], "spec_length"),
    (["--max-batch", "0"], "--max-batch"),
    (["--max-waiting", "0"], "--max-waiting"),
    (["--drafter", "nope"], "nope"),
    (["--port", "70000"], "--port"),
])
def test_serve_checks_its_arguments_before_loading_the_model(args, says, capsys, monkeypatch):
    from specdraft import decoder
    from specdraft.cli import main

    monkeypatch.setattr(decoder.SpeculativeDecoder, "from_pretrained", None)  # never reached
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdraft: error: ") and err.count("\n") == 1 and says in err


def test_serve_says_when_the_port_is_taken(capsys, monkeypatch):
    import socket

    from specdraft import decoder
    from specdraft.cli import main

    monkeypatch.setattr(decoder.SpeculativeDecoder, "from_pretrained", None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1:" in err and "--port" in err and err.count("\n") == 1


def test_a_waiting_request_whose_client_leaves_leaves_the_queue(serve, wait_for, make_fake_decoder):
    decoder = make_fake_decoder(max_batch=1, max_waiting=2)
    decoder.bursts = threading.Semaphore(0)  # no burst: the first request runs until it is closed
    with serve(create_app(decoder)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        running = client.completions.create(model="fake-model", prompt="Hi", max_tokens=60, stream=True)
        waiting = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=50, stream=True)
        assert (decoder.num_running, decoder.num_waiting) == (1, 1)
        waiting.close()  # before it got a single token
        assert wait_for(lambda: decoder.num_waiting == 0)
        assert decoder.num_running == 1
        running.close()
        assert wait_for(lambda: decoder.num_running == 0)
