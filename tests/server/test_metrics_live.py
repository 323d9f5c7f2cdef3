"""``/metrics`` as the engine steps, through the openai client over HTTP on a tiny random model with
the default model's tokenizer: a running stream's tokens, drafts and inter-token gaps are counted
before it ends (the engine is held between two rounds by an observer, never by timing), and once
it has, every count equals what the responses' usage reported; an aborted stream's tokens count
once; every metric has vLLM's name."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdraft.server import create_app
from specdraft.testing.drafters import RightThenWrong

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"

#: vLLM's histograms (vllm/v1/metrics/loggers.py), each with the ``specdraft:`` prefix
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "request_params_max_tokens", "iteration_tokens_total"]
COUNTERS = ["prompt_tokens", "generation_tokens", "request_success", "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos", "prefix_cache_queries", "prefix_cache_hits"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
#: the per-sequence histograms observed when a sequence leaves the engine
PER_SEQUENCE = ["request_time_per_output_token_seconds", "request_queue_time_seconds",
                "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"]


@pytest.fixture(scope="module")
def decoder(smol_tokenizer):
    """Fixed draft lengths (``adaptive=False``): the same bursts on every run."""
    from specdraft import SpeculativeDecoder
    from specdraft.testing import tiny_llama

    model = tiny_llama(vocab_size=len(smol_tokenizer), seed=3, max_positions=256)
    with SpeculativeDecoder(model, smol_tokenizer, drafter=RightThenWrong(model, right=2), target_name="tiny",
                            spec_length=3, adaptive=False) as dec:
        yield dec


@pytest.fixture(scope="module")
def url(decoder, serve):
    with serve(create_app(decoder)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def scrape(url: str) -> dict[str, float]:
    """``name{label="value",...}`` (model_name left out) -> value."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == "tiny"
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


class Moved:
    """How much each sample moved since ``before``."""

    def __init__(self, before: dict, after: dict) -> None:
        self.before, self.after = before, after

    def __call__(self, name: str) -> float:
        return self.after.get(f"specdraft:{name}", 0) - self.before.get(f"specdraft:{name}", 0)

    def total(self, name: str) -> float:
        """Summed over the sample's label sets."""
        def value(samples):
            return sum(v for k, v in samples.items() if k.split("{")[0] == f"specdraft:{name}")

        return value(self.after) - value(self.before)


class Gate:
    """An engine observer that counts each round's committed tokens and, after round ``hold``,
    holds the engine (inside that round, after the metrics' observer, before the round's tokens
    are sent) until :meth:`release`."""

    def __init__(self, engine, hold: int) -> None:
        self.engine, self.hold = engine, hold
        self.rounds = self.committed = 0
        self.seq = None  # the sequence of the held round's first row
        self.reached, self.open = threading.Event(), threading.Event()
        engine.observers.append(self)

    def __call__(self, report) -> None:
        if report.kind != "round":
            return
        self.rounds += 1
        self.committed += sum(row.committed for row in report.rows)
        if self.rounds == self.hold:
            self.seq = report.rows[0].seq
            self.reached.set()
            self.open.wait(60)

    def release(self) -> None:
        self.engine.observers.remove(self)  # first: the engine hears no more once it goes on
        self.open.set()


def stream(client, max_tokens: int):
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
                                     stream_options={"include_usage": True}, extra_body={"ignore_eos": True})


def test_a_running_stream_is_counted_before_it_ends(url, client, decoder):
    before = scrape(url)
    gate = Gate(decoder.engine, hold=4)
    try:
        chunks = iter(stream(client, 40))
        assert gate.reached.wait(60)
        first = next(chunks)  # a burst of the rounds before the held one
        assert first.choices[0].text
        mid = scrape(url)
        moved = Moved(before, mid)
        assert moved("generation_tokens_total") == gate.committed > 0  # the held round's burst too
        assert moved("inter_token_latency_seconds_count") == gate.rounds - 1 == 3  # one per burst after the first
        assert moved("inter_token_latency_seconds_sum") >= 0
        assert moved("prompt_tokens_total") == len(decoder.encode(PROMPT, raw=True))
        assert moved("spec_decode_num_target_passes_total") == 4
        assert moved.total("request_success_total") == 0 and moved("e2e_request_latency_seconds_count") == 0
        assert moved("request_generation_tokens_count") == 0  # observed when the sequence leaves
        assert mid["specdraft:num_requests_running"] == 1 and 0 < mid["specdraft:kv_cache_usage_perc"] <= 1
    finally:
        gate.release()
    rest = list(chunks)
    usage, info = rest[-1].usage, rest[-1].model_extra["spec_decode"]
    assert usage.completion_tokens == 40
    after = scrape(url)
    moved = Moved(before, after)
    assert moved("generation_tokens_total") == usage.completion_tokens
    assert moved("prompt_tokens_total") == usage.prompt_tokens
    assert moved("spec_decode_num_draft_tokens_total") == info["drafted_tokens"]
    assert moved("spec_decode_num_accepted_tokens_total") == info["accepted_tokens"] > 0
    assert moved("spec_decode_num_drafts_total") == info["drafts"]
    assert moved("spec_decode_num_target_passes_total") == info["target_passes"]
    per_pos = [moved(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}') for p in range(3)]
    assert sum(per_pos) == info["accepted_tokens"] and per_pos[0] == info["drafts"] and per_pos[2] == 0
    assert moved("inter_token_latency_seconds_count") == info["target_passes"] - 1
    assert moved("iteration_tokens_total_sum") == usage.prompt_tokens - 1 + usage.completion_tokens
    for name in PER_SEQUENCE:
        assert moved(f"{name}_count") == 1 and moved(f"{name}_sum") >= 0, name
    assert moved("request_generation_tokens_sum") == usage.completion_tokens
    assert moved("request_prompt_tokens_sum") == usage.prompt_tokens
    assert moved("request_params_max_tokens_sum") == 40
    assert moved('request_success_total{finished_reason="length"}') == 1
    assert moved("e2e_request_latency_seconds_count") == moved("time_to_first_token_seconds_count") == 1
    assert after["specdraft:num_requests_running"] == 0 and after["specdraft:kv_cache_usage_perc"] == 0


def test_concurrent_requests_add_up_to_their_usage(url, client):
    """Streamed and not, completions and chat, at once: nothing counted twice or left out."""
    before = scrape(url)
    results = []

    def completion():
        results.append(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=17, temperature=0,
                                                 extra_body={"ignore_eos": True}))

    def chat():  # a prediction (Predicted Outputs) that is wrong: its rows draft from it, and are refused
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=9, temperature=0, extra_body={"ignore_eos": True},
                                           prediction={"type": "content", "content": PROMPT})
        results.append(r)

    def streamed():
        chunks = list(stream(client, 23))
        results.append(chunks[-1])

    threads = [threading.Thread(target=work) for work in (completion, chat, streamed, streamed)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 4
    moved = Moved(before, scrape(url))
    assert moved("generation_tokens_total") == sum(r.usage.completion_tokens for r in results) == 17 + 9 + 23 + 23
    assert moved("prompt_tokens_total") == sum(r.usage.prompt_tokens for r in results)
    # the two streams send the same prompt: the second reads its passes from the prefix cache
    assert moved("prefix_cache_queries_total") == moved("prompt_tokens_total")
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in results]
    assert moved("prefix_cache_hits_total") == sum(cached) and max(cached) > 0
    for metric, key in [("spec_decode_num_accepted_tokens_total", "accepted_tokens"),
                        ("spec_decode_num_draft_tokens_total", "drafted_tokens"),
                        ("spec_decode_num_drafts_total", "drafts")]:
        assert moved(metric) == sum(r.model_extra["spec_decode"][key] for r in results), metric
    assert moved("inter_token_latency_seconds_count") == sum(r.model_extra["spec_decode"]["target_passes"] - 1
                                                             for r in results)
    assert moved("request_generation_tokens_count") == moved.total("request_success_total") == 4
    details = next(r.usage.completion_tokens_details for r in results if hasattr(r, "choices") and r.choices
                   and hasattr(r.choices[0], "message"))
    assert moved('prediction_tokens_total{outcome="accepted"}') == details.accepted_prediction_tokens
    assert moved('prediction_tokens_total{outcome="rejected"}') == details.rejected_prediction_tokens > 0


def test_an_aborted_stream_counts_its_tokens_once(url, client, decoder, wait_for):
    before = scrape(url)
    gate = Gate(decoder.engine, hold=3)
    try:
        response = stream(client, 60)
        assert gate.reached.wait(60)
        next(iter(response))
        response.close()  # the client goes away while the engine is held
        assert wait_for(lambda: gate.seq.aborted)  # the server has stopped it: it leaves at the next step
    finally:
        gate.release()
    assert wait_for(lambda: decoder.num_running == 0 and Moved(before, scrape(url)).total("request_success_total") == 1)
    moved = Moved(before, scrape(url))
    assert moved('request_success_total{finished_reason="abort"}') == 1
    assert moved("generation_tokens_total") == gate.committed == len(gate.seq.new_tokens) < 60  # counted once
    assert moved("request_generation_tokens_sum") == gate.committed and moved("request_generation_tokens_count") == 1


def test_every_metric_has_vllms_name(url):
    text = httpx.get(f"{url}/metrics").text
    for name in HISTOGRAMS:
        for suffix in ("_bucket", "_count", "_sum"):
            assert f"specdraft:{name}{suffix}{{" in text, name
    for name in COUNTERS:
        assert f"# TYPE specdraft:{name}_total counter" in text, name
    for name in GAUGES:
        assert f"# TYPE specdraft:{name} gauge" in text, name
    assert 'specdraft:inter_token_latency_seconds_bucket{le="0.01",' in text  # vLLM's buckets
    assert 'specdraft:iteration_tokens_total_bucket{le="16384.0",' in text
    assert 'specdraft:request_prompt_tokens_bucket{le="200.0",' in text  # 1-2-5 up to the context (256)
    assert 'le="500.0"' not in text.split("specdraft:request_prompt_tokens_bucket", 1)[1].split("# HELP")[0]
