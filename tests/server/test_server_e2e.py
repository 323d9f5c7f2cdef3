"""The server on the real default model, through the official openai client over HTTP.

Greedy answers equal the decoder's offline ``generate`` (completions: the raw prompt; chat: the
chat template with the prompt as the user's message), streamed or not, alone or among 16
concurrent clients; a closed stream frees its sequence; metrics move; every bad request gets
its status and a one-line message; and ``specdraft serve`` itself answers out of the box.
"""

from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest

import specdraft
from specdraft import SpeculativeDecoder
from specdraft.server import create_app
from specdraft.testing.commands import start_serve, stop_with_ctrl_c
from specdraft.types import Draft

pytestmark = [pytest.mark.server, pytest.mark.e2e]

PROMPTS = [
    "The days of the week are Monday, Tuesday, Wednesday,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Name three colours of the rainbow.",
    "Water boils at",
]


@pytest.fixture(scope="module")
def decoder(default_f32):
    """What ``from_pretrained(drafter="prompt-lookup")`` builds, on the session's loaded model
    (test_specdraft_serve_out_of_the_box loads it the way ``specdraft serve`` does)."""
    from specdraft.models import DEFAULT_TARGET

    model, tokenizer = default_f32
    with SpeculativeDecoder(model, tokenizer, drafter="prompt-lookup", target_name=DEFAULT_TARGET) as dec:
        yield dec


@pytest.fixture(scope="module")
def url(decoder, serve):
    with serve(create_app(decoder)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(decoder):
    return decoder.target.name


def sibling(decoder, **kwargs) -> SpeculativeDecoder:
    """Another decoder (its own engine) on the same loaded model."""
    kwargs.setdefault("drafter", "prompt-lookup")
    return SpeculativeDecoder(decoder.model, decoder.tokenizer, target_name=decoder.target.name, **kwargs)


def offline(decoder, prompt: str, max_tokens: int, raw: bool):
    return decoder.generate(prompt, max_new_tokens=max_tokens, raw=raw)[0]


def check_spec_decode(info: dict, completion_tokens: int) -> None:
    assert set(info) == {"drafted_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_target_pass",
                         "drafts", "target_passes"}
    assert 0 <= info["accepted_tokens"] <= info["drafted_tokens"] and 0 <= info["acceptance_rate"] <= 1
    assert 1 <= info["target_passes"] <= completion_tokens and info["drafts"] <= info["target_passes"]


def test_models_and_health(url, client, model):
    assert [m.id for m in client.models.list()] == [model]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_completions_equal_offline_generate(client, decoder, model, prompt):
    expected = offline(decoder, prompt, 16, raw=True)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
    assert r.usage.completion_tokens == len(expected.token_ids) and r.usage.prompt_tokens == len(
        decoder.encode(prompt, raw=True))
    check_spec_decode(r.model_extra["spec_decode"], r.usage.completion_tokens)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    check_spec_decode(chunks[-1].model_extra["spec_decode"], len(expected.token_ids))


def test_greedy_chat_equals_offline_generate(client, decoder, model):
    prompt = PROMPTS[2]
    expected = offline(decoder, prompt, 20, raw=False)  # the chat template, the prompt as the user's message
    messages = [{"role": "user", "content": prompt}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == expected.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(decoder.encode(prompt))
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_completion_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_a_resent_conversation_reads_its_beginning_from_the_prefix_cache(client, decoder, model):
    """A chat's second turn resends the first (a system prompt of over 256 tokens): its usage
    reports all of the first turn's prompt read from the prefix cache, whole and streamed, and its answer is a
    decoder's without the cache, token for token."""
    system = " ".join(f"Rule {i}: answer in a few words, politely, and never repeat the question." for i in range(24))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    r1 = client.chat.completions.create(model=model, messages=first, max_tokens=8, temperature=0)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "Name another one."}]
    r2 = client.chat.completions.create(model=model, messages=second, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=second, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    ids = decoder.encode_chat(second)
    assert r2.usage.prompt_tokens == len(ids) > 300
    # all of the first turn's prompt but its last token: a pass ends where it ended (the turn mark)
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens - 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # every pass: sent before
    with sibling(decoder, prefix_caching=False) as fresh:
        expected = fresh.generate_ids([ids], max_new_tokens=8)[0]
    assert expected.stats.cached_tokens == 0
    assert r2.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == decoder.tokenizer.decode(expected.token_ids, skip_special_tokens=True)


def test_a_prediction_drafts_and_leaves_the_answer_alone(client, decoder, model):
    """OpenAI's Predicted Outputs through the openai client: the answer equals offline greedy
    decoding whatever the prediction; usage reports the predicted tokens, streamed or not."""
    prompt = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank."
    expected = offline(decoder, prompt, 24, raw=False)
    messages = [{"role": "user", "content": prompt}]
    for prediction in (expected.text, "The quick brown cat jumps over the lazy dog near the old river bank."):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                           prediction={"type": "content", "content": prediction})
        assert r.choices[0].message.content == expected.text
        details = r.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
        assert details.accepted_prediction_tokens <= r.usage.completion_tokens
        chunks = list(client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
            prediction={"type": "content", "content": [{"type": "text", "text": prediction}]}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
        # the counts themselves follow the measured verify costs (the prediction's draft length
        # adapts to them), so a stream's may differ from the whole answer's; their sense may not
        streamed = chunks[-1].usage.completion_tokens_details
        assert streamed.accepted_prediction_tokens > 0 and streamed.rejected_prediction_tokens >= 0
        assert streamed.accepted_prediction_tokens <= chunks[-1].usage.completion_tokens
    completion = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                           extra_body={"prediction": {"type": "content", "content": " Thursday,"}})
    assert completion.choices[0].text == offline(decoder, PROMPTS[0], 12, raw=True).text
    with pytest.raises(openai.BadRequestError, match="prediction"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                       prediction={"type": "content", "content": 42})
    with pytest.raises(openai.BadRequestError, match="prediction works with n=1 only"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, n=2,
                                       prediction={"type": "content", "content": expected.text})


def test_16_concurrent_streaming_clients(client, decoder, model):
    """Mixed lengths, greedy and seeded sampling, completions and chat, all at once."""
    jobs = []
    for i in range(16):
        prompt, max_tokens, chat = PROMPTS[i % 4], 8 + (i * 5) % 17, i % 3 == 0
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": i}
        jobs.append((prompt, max_tokens, chat, sampling))
    results: dict[int, tuple[str, str, int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        prompt, max_tokens, chat, sampling = jobs[i]
        try:
            if chat:
                chunks = list(client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True,
                    stream_options={"include_usage": True}, **sampling))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                        stream=True, stream_options={"include_usage": True},
                                                        **sampling))
                text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            results[i] = (text, reason, chunks[-1].usage.completion_tokens)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(results) == 16
    for i, (prompt, max_tokens, chat, sampling) in enumerate(jobs):
        text, reason, completion_tokens = results[i]
        if sampling["temperature"] == 0:
            expected = offline(decoder, prompt, max_tokens, raw=not chat)
            assert text == expected.text, i
            assert completion_tokens == len(expected.token_ids), i
        assert (reason == "length" and completion_tokens == max_tokens) or (
            reason == "stop" and completion_tokens <= max_tokens), (i, reason, completion_tokens)
    assert decoder.num_running == 0 and decoder.num_waiting == 0


def test_a_closed_stream_frees_its_sequence(client, decoder, model, wait_for):
    stream = client.completions.create(model=model, prompt="Count from one to one thousand: one, two,",
                                       max_tokens=500, temperature=0, stream=True)
    next(iter(stream))
    assert decoder.num_running == 1
    stream.close()
    assert wait_for(lambda: decoder.num_running == 0, timeout=60)


def test_metrics_move(url, client, model):
    def value(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    before = httpx.get(f"{url}/metrics").text
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    after = httpx.get(f"{url}/metrics").text
    assert value(after, "specdraft:generation_tokens_total") - value(before, "specdraft:generation_tokens_total") \
        == r.usage.completion_tokens
    assert value(after, "specdraft:prompt_tokens_total") - value(before, "specdraft:prompt_tokens_total") \
        == r.usage.prompt_tokens
    for name in ("specdraft:spec_decode_num_draft_tokens_total", "specdraft:spec_decode_num_accepted_tokens_total",
                 "specdraft:spec_decode_num_drafts_total"):
        key = {"specdraft:spec_decode_num_draft_tokens_total": "drafted_tokens",
               "specdraft:spec_decode_num_accepted_tokens_total": "accepted_tokens",
               "specdraft:spec_decode_num_drafts_total": "drafts"}[name]
        assert value(after, name) - value(before, name) == r.model_extra["spec_decode"][key], name
    assert value(after, "specdraft:e2e_request_latency_seconds_count") \
        == value(before, "specdraft:e2e_request_latency_seconds_count") + 1
    assert value(after, "specdraft:request_success_total") == value(before, "specdraft:request_success_total") + 1
    assert "specdraft:num_requests_running" in after and "specdraft:time_to_first_token_seconds_bucket" in after


def one_line_error(caught) -> dict:
    body = caught.value.body
    assert body["message"] and "\n" not in body["message"] and "Traceback" not in body["message"]
    return body


def test_bad_requests_get_their_status_and_one_line(client, model, decoder):
    cases = [
        (openai.BadRequestError, dict(prompt="Hi", temperature=-0.5), "temperature"),
        (openai.BadRequestError, dict(prompt="Hi", n=129), "less than or equal to 128"),
        (openai.BadRequestError, dict(prompt="Hi", logprobs=21), "logprobs"),
        (openai.BadRequestError, dict(prompt="Hi " * 9000), "context"),  # longer than the context
        (openai.NotFoundError, dict(prompt="Hi", model="gpt-4o"), "gpt-4o"),
    ]
    for error, kwargs, says in cases:
        with pytest.raises(error) as caught:
            client.completions.create(**{"model": model, "max_tokens": 4, **kwargs})
        assert says in one_line_error(caught)["message"], kwargs
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], top_p=7)
    assert "top_p" in one_line_error(caught)["message"]
    assert decoder.num_running == 0 and decoder.num_waiting == 0


def test_api_key(decoder, model, serve):
    with serve(create_app(decoder, api_key="sesame")) as base:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2},
                           headers=headers)
            assert r.status_code == 401 and "\n" not in r.json()["error"]["message"]
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sesame", max_retries=0, timeout=120)
        assert good.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0).usage.completion_tokens


def test_queue_full_is_429(decoder, model, serve, wait_for):
    busy = sibling(decoder, max_batch=1, max_waiting=1)
    with serve(create_app(busy)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        long = dict(model=model, prompt="Count from one to one thousand: one, two,", max_tokens=400, temperature=0,
                    stream=True)
        running = client.completions.create(**long)
        next(iter(running))  # it holds the one place in the batch
        waiting = client.completions.create(**long)  # submitted: it waits
        assert wait_for(lambda: (busy.num_running, busy.num_waiting) == (1, 1))
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert caught.value.status_code == 429 and "retry" in one_line_error(caught)["message"]
        running.close()
        waiting.close()
        assert wait_for(lambda: busy.num_running + busy.num_waiting == 0, timeout=60)
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


class ExplodingDrafter(specdraft.Drafter):
    """Drafts nothing; raises in the round after ``armed`` is set."""

    api_version = 2
    name = "exploding"
    armed = False

    def propose(self, ctx, k):
        if self.armed:
            self.armed = False
            raise RuntimeError("boom")
        return Draft.empty(ctx.batch_size, device=ctx.device)


def test_a_failing_drafter_is_500_naming_it_and_the_server_goes_on(decoder, model, serve):
    drafter = ExplodingDrafter(ExplodingDrafter.Options(), decoder.target)
    failing = sibling(decoder, drafter=drafter)
    with serve(create_app(failing)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        drafter.armed = True
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=8, temperature=0)
        assert "exploding" in one_line_error(caught)["message"]
        drafter.armed = True  # in a stream: an error event, then [DONE]
        with pytest.raises(openai.APIError, match="exploding"):
            list(client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=8, temperature=0, stream=True))
        r = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=8, temperature=0)
        assert r.choices[0].text == offline(decoder, PROMPTS[3], 8, raw=True).text


def test_specdraft_serve_out_of_the_box(tmp_path):
    """The real command: loads the default model, prints its ready line, answers, stops on Ctrl-C."""
    served = start_serve(tmp_path, "--drafter", "prompt-lookup", "--max-batch", "2")
    try:
        assert served.ready.startswith("specdraft: serving ") and " with drafter prompt-lookup on http://127.0.0.1:" in served.ready
        models = httpx.get(f"{served.base}/v1/models", timeout=30).json()["data"]
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model=models[0]["id"], prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8 and r.choices[0].text
    finally:
        code = stop_with_ctrl_c(served.proc)  # uvicorn shuts down, then the CLI exits 130 as for generate
    assert code == 130
    assert "Traceback" not in served.stderr.read_text()


def gauge(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_sigterm_drains_every_request_cleanly(tmp_path, wait_for):
    """SIGTERM with requests running and waiting: the waiting ones end at once (a stream: one
    error event with code server_shutting_down, then [DONE]; otherwise a 503 naming the code), a
    running one finishes within the drain time, new requests and /health get 503, a second
    SIGTERM ends the rest the same way, and the process exits 0 without a traceback."""
    proc, _, base, err = start_serve(tmp_path, "--drafter", "prompt-lookup", "--max-batch", "3", "--max-waiting", "8",
                                     "--drain-timeout", "120")
    results: dict[str, tuple[int, list]] = {}
    started = {name: threading.Event() for name in ("long1", "long2", "medium")}

    def stream(name: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": ignore_eos}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    if name in started and line != "data: [DONE]" and events[-1].get("choices"):
                        started[name].set()
        results[name] = (r.status_code, events)

    def whole(name: str) -> None:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0},
                       timeout=300)
        results[name] = (r.status_code, [r.json()])

    count = "Count from one to one thousand: one, two,"
    # running until the second signal whatever the model says (greedy bfloat16 decoding ends this count
    # with EOS after 35 tokens on an AMX Xeon): a drain that ended by itself before the second signal
    # takes it as a third (stop without waiting: no lifespan shutdown, a CancelledError traceback)
    threads = [threading.Thread(target=stream, args=(n, count, 3000, True)) for n in ("long1", "long2")]
    threads.append(threading.Thread(target=stream, args=("medium", "Water boils at", 64)))
    for t in threads:
        t.start()
    assert wait_for(lambda: all(e.is_set() or n in results for n, e in started.items()), timeout=120)
    assert all(e.is_set() for e in started.values()), results  # three running: the batch is full
    waiting = [threading.Thread(target=stream, args=(f"wait-stream{i}", PROMPTS[i], 4)) for i in range(2)]
    waiting += [threading.Thread(target=whole, args=(f"wait-whole{i}",)) for i in range(2)]
    for t in waiting:
        t.start()
    assert wait_for(lambda: gauge(base, "specdraft:num_requests_waiting") == 4, timeout=60)
    try:
        proc.send_signal(signal.SIGTERM)
        for t in waiting:
            t.join(60)
        for i in range(2):  # waiting: ended at once
            status, events = results[f"wait-stream{i}"]
            assert status == 200 and events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "server_shutting_down" and "\n" not in events[-2]["error"]["message"]
            status, (body,) = results[f"wait-whole{i}"]
            assert status == 503 and body["error"]["code"] == "server_shutting_down"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(f"{base}/health", timeout=30).status_code == 503
        threads[2].join(120)  # running (unless it finished before the signal): it has the drain time to finish
        status, events = results["medium"]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("length", "stop"), events[-3:]
        assert not any("error" in e for e in events[:-1])
        proc.send_signal(signal.SIGTERM)  # a second signal: the rest end now
        for t in threads:
            t.join(60)
        for name in ("long1", "long2"):
            status, events = results[name]
            assert status == 200 and events[-1] == "[DONE]"
            last = events[-2]
            assert (last.get("error", {}).get("code") == "server_shutting_down"
                    or last["choices"][0]["finish_reason"] in ("length", "stop")), last
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = err.read_text()
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]
    assert "shutting down: new requests get 503, 4 waiting requests were ended (503)" in log
