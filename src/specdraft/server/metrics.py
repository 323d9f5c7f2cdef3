"""Prometheus metrics of one server, named like vLLM's with a ``specdraft:`` prefix.

Every app has its own :class:`prometheus_client.CollectorRegistry` (never the global one), so
several apps in one process (tests, embedding) count separately. prometheus_client appends
``_total`` to counters' names in the exposition (``specdraft:prompt_tokens_total``).

Tokens, drafts and acceptances are counted as the engine steps: :class:`ServerMetrics` observes
its decoder (``SpeculativeDecoder.observe``, the engine's reports: :mod:`specdraft.engine.report`), so a long stream's tokens show
in ``rate()`` while it runs, and a client that has received tokens finds them counted. Each
sequence's timing histograms (queue, prefill, decode, time per output token) are observed when
it leaves the engine; what the HTTP layer sees (a request's outcome, its end-to-end latency, its
time to first token, error responses) is counted by the app. A decoder without an engine (a
test's stand-in) has its requests' tokens counted when they finish instead.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # also the queue, prefill, decode and inference times
#: inter-token latency and each request's time per output token
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's buckets of token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@runtime_checkable
class SteppingDecoder(Protocol):
    """A decoder that reports its engine's steps (:class:`~specdraft.SpeculativeDecoder`): what the
    metrics read of it. A decoder without them (a test's stand-in) is counted as requests finish."""

    @property
    def kv_cache_usage(self) -> float: ...

    def observe(self, observer: Callable[[Any], None]) -> Callable[[], None]: ...


class ServerMetrics:
    """The counters, histograms and gauges of one app: it observes ``decoder``'s engine as it
    steps (:meth:`observe`); :meth:`record` adds a request the app has answered."""

    def __init__(self, decoder, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        names = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(f"specdraft:{name}", doc, [*names, *extra], registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(f"specdraft:{name}", doc, names, buckets=buckets, registry=registry)

        self._counters(counter)
        self._histograms(histogram, decoder.target)
        kv = self._gauges(decoder, names)
        #: counted as the engine steps (else, a decoder that reports no steps: when requests finish)
        self.per_step = isinstance(decoder, SteppingDecoder)
        if self.per_step:
            kv.labels(**labels).set_function(lambda: decoder.kv_cache_usage)
            _subscribe(self, decoder)
        else:
            kv.labels(**labels).set(0.0)
        self._bind()

    def _counters(self, counter) -> None:
        """vLLM's counters (speculation's, tokens', requests')."""
        self.num_drafts = counter("spec_decode_num_drafts", "Rounds that drafted at least one token (per sequence).")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens the target verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0 = first).", ["position"])
        self.target_passes = counter("spec_decode_num_target_passes", "Verify passes of the target model "
                                                                      "(per sequence: a round of 4 counts 4).")
        self.prediction_tokens = counter("prediction_tokens", "Predicted tokens (Predicted Outputs) the target "
                                                              "verified, by outcome.", ["outcome"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens, counted when a prompt's prefill completes.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                                                    "(every prompt's, as its prefill completes).")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens the prefix cache held (copied, not "
                                                              "prefilled).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens, counted as each step commits them.")
        self.request_success = counter("request_success", "Finished requests by finish reason (abort: the "
                                                          "client went away first).", ["finished_reason"])
        self.request_errors = counter("request_errors", "Requests answered with an error, by HTTP status.",
                                      ["status"])

    def _histograms(self, histogram, target) -> None:
        """vLLM's latency and size histograms."""
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Time from a request's arrival to its last token.",
                                     E2E_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Time from a request's arrival to its first generated "
                                                            "token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a sequence's successive bursts of tokens "
                                                           "(a speculative round's burst is one observation).",
                             ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Per sequence: its decode time over its "
                                                                       "output tokens after the first.", ITL_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Per sequence: time from its submission to its "
                                                                  "admission into the batch.", E2E_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Per sequence: time from its admission to its "
                                                                      "first output token.", E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Per sequence: time from its first output "
                                                                    "token to its last.", E2E_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Per sequence: time from its admission "
                                                                          "to its last output token.", E2E_BUCKETS)
        sizes = build_1_2_5_buckets(int(getattr(target, "max_context", 0) or 0) or 8192)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Per sequence: its prompt's tokens.", sizes)
        self.request_generation_tokens = histogram("request_generation_tokens", "Per sequence: its output tokens.",
                                                   sizes)
        self.max_tokens = histogram("request_params_max_tokens", "Per sequence: its max_tokens (or the default "
                                                                 "it got).", sizes)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine pass: a round's generated "
                                                                    "tokens, a prefill pass's prompt tokens.",
                                          ITERATION_BUCKETS)

    def _gauges(self, decoder, names: list[str]):
        """The running and waiting requests (read from ``decoder`` when scraped); returns the KV
        cache usage gauge, which the caller binds."""
        labels, registry = self._labels, self.registry
        running = Gauge("specdraft:num_requests_running", "Requests the engine is decoding.", names,
                        registry=registry)
        running.labels(**labels).set_function(lambda: decoder.num_running)
        waiting = Gauge("specdraft:num_requests_waiting", "Requests waiting for a place in the batch.",
                        names, registry=registry)
        waiting.labels(**labels).set_function(lambda: decoder.num_waiting)
        return Gauge("specdraft:kv_cache_usage_perc", "Fraction (0..1) of --kv-cache-memory running requests reserve.",
                     names, registry=registry)

    def _bind(self) -> None:
        """The label-bound children the engine's thread updates every round (``labels()`` looks each up)."""
        labels = self._labels
        self._generation = self.generation_tokens.labels(**labels)
        self._prompt = self.prompt_tokens.labels(**labels)
        self._queries = self.prefix_cache_queries.labels(**labels)
        self._hits = self.prefix_cache_hits.labels(**labels)
        self._drafts = self.num_drafts.labels(**labels)
        self._draft_tokens = self.num_draft_tokens.labels(**labels)
        self._accepted = self.num_accepted_tokens.labels(**labels)
        self._passes = self.target_passes.labels(**labels)
        self._predicted = {o: self.prediction_tokens.labels(outcome=o, **labels) for o in ("accepted", "rejected")}
        self._per_pos: list = []
        self._itl = self.itl.labels(**labels)
        self._iteration = self.iteration_tokens.labels(**labels)

    def _position(self, position: int):
        while len(self._per_pos) <= position:
            self._per_pos.append(self.accepted_per_pos.labels(position=str(len(self._per_pos)), **self._labels))
        return self._per_pos[position]

    # -- the engine's reports (its thread) ------------------------------------------------------

    def observe(self, report) -> None:
        """Count an engine's :class:`~specdraft.engine.report.StepReport`."""
        if report.kind == "round":
            self._round(report)
        elif report.kind == "prefill":
            self._iteration.observe(report.tokens)
        elif report.kind == "finish":
            self._finished(report.rows[0].seq)

    def _round(self, report) -> None:
        generated = 0
        for row in report.rows:
            generated += row.committed
            if row.gap is None:  # its first tokens: its prompt is prefilled (counted here, as vLLM)
                self._prompt.inc(row.seq.prompt_len)
                self._queries.inc(row.seq.prompt_len)
                self._hits.inc(row.seq.stats.cached_tokens)
            else:
                self._itl.observe(row.gap)
            self._passes.inc()
            if row.drafted:
                self._drafts.inc()
                self._draft_tokens.inc(row.drafted)
                self._accepted.inc(row.accepted)
                for position in range(row.accepted):
                    self._position(position).inc()
            if row.predicted:
                self._predicted["accepted"].inc(row.accepted)
                self._predicted["rejected"].inc(row.drafted - row.accepted)
        self._generation.inc(generated)
        self._iteration.observe(generated)

    def _finished(self, seq) -> None:
        """A sequence left the engine: its lengths and the times between its stamps (vLLM's
        definitions: queue = admitted - submitted, prefill = first token - admitted, decode = last
        token - first token, inference = last token - admitted)."""
        labels = self._labels
        n = len(seq.new_tokens)
        self.request_prompt_tokens.labels(**labels).observe(seq.prompt_len)
        self.request_generation_tokens.labels(**labels).observe(n)
        self.max_tokens.labels(**labels).observe(seq.max_new_tokens)
        if seq.admitted is None:
            return
        self.queue_time.labels(**labels).observe(max(0.0, seq.admitted - seq.submitted))
        if seq.first_token is None:
            return
        decode = max(0.0, seq.last_token - seq.first_token)
        self.prefill_time.labels(**labels).observe(max(0.0, seq.first_token - seq.admitted))
        self.decode_time.labels(**labels).observe(decode)
        self.inference_time.labels(**labels).observe(max(0.0, seq.last_token - seq.admitted))
        if n > 1:
            self.tpot.labels(**labels).observe(decode / (n - 1))

    # -- the app's requests ---------------------------------------------------------------------

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(**self._labels).observe(seconds)

    def error(self, status: int) -> None:
        self.request_errors.labels(status=str(status), **self._labels).inc()

    def record(self, result, seconds: float, finished_reason: str) -> None:
        """Count a finished (or aborted) request: its outcome and latency (its tokens and
        speculation were counted as the engine stepped; here only for a decoder without an engine)."""
        labels = self._labels
        self.request_success.labels(finished_reason=finished_reason, **labels).inc()
        self.e2e_latency.labels(**labels).observe(seconds)
        if result is None or self.per_step:
            return
        stats = result.stats
        self.prompt_tokens.labels(**labels).inc(stats.prompt_tokens)
        self.prefix_cache_queries.labels(**labels).inc(stats.prompt_tokens)
        self.prefix_cache_hits.labels(**labels).inc(stats.cached_tokens)
        self.generation_tokens.labels(**labels).inc(stats.new_tokens)
        self.num_drafts.labels(**labels).inc(stats.drafts)
        self.num_draft_tokens.labels(**labels).inc(stats.drafted_tokens)
        self.num_accepted_tokens.labels(**labels).inc(stats.accepted_tokens)
        self.target_passes.labels(**labels).inc(stats.target_passes)
        self.prediction_tokens.labels(outcome="accepted", **labels).inc(stats.accepted_prediction_tokens)
        self.prediction_tokens.labels(outcome="rejected", **labels).inc(stats.rejected_prediction_tokens)
        for position, accepted in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(position=str(position), **labels).inc(accepted)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _subscribe(metrics: ServerMetrics, decoder: "SteppingDecoder") -> None:
    """Have ``decoder`` report its steps to ``metrics`` by weak reference: a dropped app's metrics
    go (and stop their reports) rather than being kept alive by the engine."""
    ref = weakref.WeakMethod(metrics.observe)

    def observer(report) -> None:
        observe = ref()
        if observe is None:
            stop()
            return
        observe(report)

    stop = decoder.observe(observer)
