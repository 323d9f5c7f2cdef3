"""Prometheus metrics of one server, named like vLLM's with a ``specdraft:`` prefix.

Every app has its own :class:`prometheus_client.CollectorRegistry` (never the global one), so
several apps in one process (tests, embedding) count separately. prometheus_client appends
``_total`` to counters' names in the exposition (``specdraft:prompt_tokens_total``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The counters, histograms and gauges of one app; :meth:`record` adds a finished request."""

    def __init__(self, decoder, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        names = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(f"specdraft:{name}", doc, [*names, *extra], registry=registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Rounds that drafted at least one token.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens the target verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0 = first).", ["position"])
        self.target_passes = counter("spec_decode_num_target_passes", "Verify passes of the target model.")
        self.prediction_tokens = counter("prediction_tokens", "Predicted tokens (Predicted Outputs) the target "
                                                              "verified, by outcome.", ["outcome"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests.")
        self.request_success = counter("request_success", "Finished requests by finish reason (abort: the "
                                                          "client went away first).", ["finished_reason"])
        self.request_errors = counter("request_errors", "Requests answered with an error, by HTTP status.",
                                      ["status"])
        self.e2e_latency = Histogram("specdraft:e2e_request_latency_seconds",
                                     "Time from a request's arrival to its last token.", names,
                                     buckets=E2E_BUCKETS, registry=registry)
        self.ttft = Histogram("specdraft:time_to_first_token_seconds",
                              "Time from a request's arrival to its first generated token.", names,
                              buckets=TTFT_BUCKETS, registry=registry)
        running = Gauge("specdraft:num_requests_running", "Requests the engine is decoding.", names,
                        registry=registry)
        running.labels(**labels).set_function(lambda: decoder.num_running)
        waiting = Gauge("specdraft:num_requests_waiting", "Requests waiting for a place in the engine's batch.",
                        names, registry=registry)
        waiting.labels(**labels).set_function(lambda: decoder.num_waiting)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(**self._labels).observe(seconds)

    def error(self, status: int) -> None:
        self.request_errors.labels(status=str(status), **self._labels).inc()

    def record(self, result, seconds: float, finished_reason: str) -> None:
        """Count a finished (or aborted) request: its tokens, its speculation and its latency."""
        labels = self._labels
        self.request_success.labels(finished_reason=finished_reason, **labels).inc()
        self.e2e_latency.labels(**labels).observe(seconds)
        if result is None:
            return
        stats = result.stats
        self.prompt_tokens.labels(**labels).inc(stats.prompt_tokens)
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
