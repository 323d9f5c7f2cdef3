"""``specdraft bench-serve``: ``specdraft serve`` under load from concurrent streaming clients.

For each drafter (``none`` = plain decoding through the same engine) a ``specdraft serve``
subprocess listens on a free port of 127.0.0.1 (or ``--url`` names a running server). At each
concurrency C, C client threads send Spec-Bench prompts (first turn) as streaming chat
completions at temperature 0, each client sending its next prompt when its answer ends, until
``--num-prompts`` are answered. Levels run in turn, every drafter at one level before the next
level, so a busy machine weighs on all drafters alike. Definitions, per drafter and level:

* ``tokens_per_second`` = output tokens of all requests / wall time from the first request
  sent to the last answer received; ``speedup`` = that / ``none``'s at the same concurrency;
* ``ttft``: from sending a request to its first chunk with text; ``e2e``: to its last event;
* ``itl`` (inter-token latency): a chunk carries several tokens (one burst of accepted tokens),
  so each chunk after the first gives one sample, the time since the previous chunk divided by
  the chunk's tokens. Those are counted by the target's tokenizer on the chunk's text and
  scaled so that a request's chunks add up to its ``usage.completion_tokens``;
* ``chunk gap``: the time between successive chunks of a request (what its reader waits, whatever
  the chunk carries), p90 and longest over all requests: a long prompt joining shows here;
* ``tokens_per_pass`` = output tokens / target passes (``spec_decode`` of the final chunk);
* ``mismatches``: answers whose text differs from ``none``'s for the same prompt (greedy: 0);
* ``prediction accepted / rejected``: the summed ``usage.completion_tokens_details`` of the
  requests that carried a prediction (``-``: none did).

A row of the questions may carry a ``prediction`` (text the answer is expected to mostly repeat):
it is sent as OpenAI's ``"prediction": {"type": "content", "content": ...}`` to every drafter's
server, not to ``none`` (plain decoding runs without it, as in ``specdraft bench``), nor with the
warm-up requests. The prompts go out interleaved by category, each category's rows in file
order, so a stream of the repeated-work workload reaches the server in order: a drafter that
learns across requests sees the earlier ones of its stream first (at concurrency > 1 some of a
stream run at the same time).

``--fixed-batch N`` also runs, in this process, N requests of mixed lengths (max_tokens drawn
from --max-tokens/8 to 2 x --max-tokens) through one decoder per drafter in two ways: in waves
of ``--max-batch`` requests, each wave starting only when the previous one has completely
finished (what a fixed-batch ``generate(prompts)`` did), and all N submitted at once (continuous
batching: a request joins as soon as another leaves). Each way runs twice (waves, continuous,
continuous, waves); its figure is output tokens / wall time over both runs, and ``mismatches``
counts outputs that differ between runs (greedy: 0).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..cli_args import device_args, parse_drafter_option, resolve_methods, speculative_config_arg
from ..errors import ConfigError, SpecdraftError
from .harness import load_questions, split_method

PLAIN = "none"
#: seconds a server may take to load its model and answer /health
START_TIMEOUT_S = 600
#: seconds one request may take
REQUEST_TIMEOUT_S = 900
#: --fixed-batch runs each mode twice, in this order, so a drift in the machine's speed weighs on both alike
ORDER = ("waves", "continuous", "continuous", "waves")


def add_bench_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench-serve`` on the ``specdraft`` command's subparsers."""
    p = subparsers.add_parser(
        "bench-serve", help="load-test `specdraft serve`: concurrent streaming clients, per drafter",
        description="Start `specdraft serve` for each drafter (or use --url), send Spec-Bench prompts from N "
                    "concurrent streaming clients at each concurrency, and report throughput, time to first "
                    "token, inter-token and end-to-end latency; write results.json and results.md.")
    p.add_argument("--questions", required=True, metavar="FILE.jsonl",
                   help="Spec-Bench schema: question_id, category, turns (the first turn is used), and an "
                        f"optional prediction, sent to the drafters' servers (not to '{PLAIN}')")
    p.add_argument("--drafters", "--drafter", default=None,
                   help=f"comma-separated; '{PLAIN}' is plain decoding through the same engine; LABEL=DRAFTER "
                        f"as for bench (default: {PLAIN},prompt-lookup)")
    p.add_argument("--drafter-option", dest="drafter_options", action="append", type=parse_drafter_option, default=[],
                   metavar="DRAFTER:KEY=VALUE", help="an option for one of the drafters (repeatable)")
    p.add_argument("--server-option", dest="server_options", action="append", type=parse_drafter_option,
                   default=[], metavar="LABEL:FLAG=VALUE",
                   help="`specdraft serve --FLAG VALUE` for one label's server (repeatable), e.g. "
                        "--drafters none,whole=none --server-option whole:chunked-prefill-size=0")
    p.add_argument("--spec-length", type=int, default=None, metavar="K", help="default: 4")
    speculative_config_arg(p, f"the one drafter to serve (beside '{PLAIN}'), in place of --drafters, --spec-length "
                              "and --drafter-option")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (default: 1,4,16)")
    p.add_argument("--num-prompts", type=int, default=None, metavar="N",
                   help="requests per concurrency level (default: 2 x concurrency, at least 8)")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="per request (default: 128)")
    p.add_argument("--multi-turn", action="store_true",
                   help="send each question's turns as one conversation (after its 'system' prompt, if any), each "
                        "turn resending the conversation so far with the answers; a client sends a conversation's "
                        "turns in order; --num-prompts counts conversations. Reports the prefix cache's hit rate "
                        "(cached_tokens over prompt_tokens, from the second turn on). The workload: "
                        "python -m specdraft.bench.workloads --multi-turn N")
    p.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="the server's --max-batch, and the wave size of --fixed-batch (default: 8)")
    p.add_argument("--fixed-batch", type=int, default=0, metavar="N",
                   help="also compare fixed-batch waves with continuous batching on N mixed-length requests, "
                        "in this process (0 = skip; default: 0)")
    p.add_argument("--url", default=None,
                   help="measure this running server (http://HOST:PORT) instead of starting one; --drafters then "
                        "names its one drafter")
    p.add_argument("--output", default="bench-serve-out", metavar="DIR", help="default: bench-serve-out")
    p.add_argument("--target", default=None, help="as for serve (default: SmolLM2-135M-Instruct)")
    device_args(p)
    return p


# -- one streamed request ---------------------------------------------------------------------


@dataclass
class Request:
    """One chat completion: what was sent, and when each part of the answer came."""

    index: int  # the prompt's place in the list (same prompt, same index, for every drafter)
    question_id: int
    prompt: str
    max_tokens: int
    prediction: str | None = None  # sent as OpenAI's Predicted Outputs
    #: --multi-turn: the conversation's system prompt (None: none) and this request's turn (0: the first);
    #: ``messages`` is filled in when the turns before have been answered
    system: str | None = None
    turn: int = 0
    messages: list | None = None
    tools: list | None = None  # sent with tool_choice (tool calling); the calls' deltas count as text
    tool_choice: object = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    sent: float = 0.0
    chunks: list[tuple[float, str]] = field(default_factory=list)  # (arrival, text) of chunks with text
    done: float = 0.0
    completion_tokens: int = 0
    target_passes: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is None and self.finish_reason is not None and self.done > 0

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.chunks)


def request_body(req: Request) -> dict:
    """The chat completion ``req`` sends: streamed, temperature 0, usage included, and its prediction."""
    messages = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
    body = {"messages": messages, "max_tokens": req.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if req.prediction is not None:
        body["prediction"] = {"type": "content", "content": req.prediction}
    if req.tools is not None:
        body["tools"] = req.tools
        if req.tool_choice is not None:
            body["tool_choice"] = req.tool_choice
    return body


def delta_text(delta: dict) -> str:
    """A streamed delta's text: its content, and the names and arguments of its calls (tool calling)."""
    calls = [call.get("function") or {} for call in delta.get("tool_calls") or ()]
    return (delta.get("content") or "") + "".join((f.get("name") or "") + (f.get("arguments") or "") for f in calls)


def send(client, url: str, req: Request) -> None:
    """Stream ``req`` as a chat completion (:func:`request_body`) and time its chunks."""
    import httpx

    body = request_body(req)
    req.sent = time.perf_counter()
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                req.error = f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, event = time.perf_counter(), json.loads(line[6:])
                if "error" in event:
                    req.error = event["error"].get("message", "error")
                for choice in event.get("choices") or []:
                    text = delta_text(choice.get("delta", {}))
                    if text:
                        req.chunks.append((now, text))
                    req.finish_reason = choice.get("finish_reason") or req.finish_reason
                if event.get("usage"):
                    req.completion_tokens = event["usage"]["completion_tokens"]
                    req.prompt_tokens = event["usage"].get("prompt_tokens") or 0
                    req.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    req.target_passes = (event.get("spec_decode") or {}).get("target_passes", 0)
                    details = event["usage"].get("completion_tokens_details") or {}
                    req.accepted_prediction_tokens = details.get("accepted_prediction_tokens") or 0
                    req.rejected_prediction_tokens = details.get("rejected_prediction_tokens") or 0
    except httpx.HTTPError as exc:
        req.error = f"{type(exc).__name__}: {exc}"
    finally:
        req.done = time.perf_counter()


def run_level(url: str, requests: list[Request], concurrency: int) -> float:
    """Send ``requests`` from ``concurrency`` client threads (each sends its next one when its answer
    has ended; a conversation's turns, :func:`conversations`, one after another by one client);
    returns the wall time from the first request sent to the last answer."""
    import httpx

    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for turns in conversations(requests):
        jobs.put(turns)

    def client_loop() -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            while True:
                try:
                    turns = jobs.get_nowait()
                except queue.Empty:
                    return
                history = [{"role": "system", "content": turns[0].system}] if turns[0].system else []
                for req in turns:
                    history.append({"role": "user", "content": req.prompt})
                    req.messages = list(history)
                    send(client, url, req)
                    if not req.finished:
                        break  # the conversation cannot go on without the answer
                    history.append({"role": "assistant", "content": req.text})

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(r.done for r in requests) - min(r.sent for r in requests)


def conversations(requests: list[Request]) -> list[list[Request]]:
    """The requests grouped by conversation (a question's turns, in order); one each without --multi-turn."""
    groups: dict[int, list[Request]] = {}
    for req in requests:
        groups.setdefault(req.index - req.turn, []).append(req)
    return list(groups.values())


# -- metrics ----------------------------------------------------------------------------------


def _percentiles(values: list[float], scale: float = 1.0) -> dict:
    import numpy as np

    if not values:
        return {"p50": None, "p90": None}
    p50, p90 = np.percentile(values, [50, 90])
    return {"p50": float(p50) * scale, "p90": float(p90) * scale}


def _gaps(values: list[float]) -> dict:
    """p90 and longest of the gaps between chunks, in ms."""
    import numpy as np

    if not values:
        return {"p90": None, "max": None}
    return {"p90": float(np.percentile(values, 90)) * 1e3, "max": max(values) * 1e3}


def inter_token_latencies(req: Request, count_tokens: Callable[[str], int]) -> list[float]:
    """Seconds per token of each chunk after the first: the time since the previous chunk over the
    chunk's tokens (the tokenizer's count, scaled to add up to ``completion_tokens``)."""
    counts = [max(1, count_tokens(text)) for _, text in req.chunks]
    scale = req.completion_tokens / sum(counts) if req.completion_tokens and counts else 1.0
    return [(req.chunks[i][0] - req.chunks[i - 1][0]) / (counts[i] * scale) for i in range(1, len(req.chunks))]


def chunk_gaps(req: Request) -> list[float]:
    """Seconds between successive chunks of a request: how long its reader waited, whatever the
    chunk carried (a newcomer's prefill shows here as one long gap)."""
    return [req.chunks[i][0] - req.chunks[i - 1][0] for i in range(1, len(req.chunks))]


def summarize_level(drafter: str, concurrency: int, requests: list[Request], wall_s: float,
                    count_tokens: Callable[[str], int]) -> dict:
    ok = [r for r in requests if r.finished]
    tokens = sum(r.completion_tokens for r in ok)
    passes = sum(r.target_passes for r in ok)
    return {
        "drafter": drafter,
        "concurrency": concurrency,
        "requests": len(requests),
        "finished": len(ok),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_second": tokens / wall_s if wall_s > 0 else 0.0,
        "speedup": None,  # filled in against none's row
        "ttft_ms": _percentiles([r.chunks[0][0] - r.sent for r in ok if r.chunks], 1e3),
        "itl_ms": _percentiles([x for r in ok for x in inter_token_latencies(r, count_tokens)], 1e3),
        "e2e_s": _percentiles([r.done - r.sent for r in ok]),
        "gap_ms": _gaps([x for r in ok for x in chunk_gaps(r)]),
        "tokens_per_pass": tokens / passes if passes else None,
        "accepted_prediction_tokens": sum(r.accepted_prediction_tokens for r in ok),
        "rejected_prediction_tokens": sum(r.rejected_prediction_tokens for r in ok),
        "mismatches": None,  # filled in against none's row
        # the prefix cache: prompt tokens it held over prompt tokens, from each conversation's second turn on
        "hit_rate": _hit_rate([r for r in ok if r.turn > 0]),
        "first_turn_ttft_ms": _percentiles([r.chunks[0][0] - r.sent for r in ok if r.chunks and r.turn == 0], 1e3),
        "later_turns_ttft_ms": _percentiles([r.chunks[0][0] - r.sent for r in ok if r.chunks and r.turn > 0], 1e3),
        "errors": sorted({r.error for r in requests if r.error}),
        "records": [{"index": r.index, "question_id": r.question_id, "max_tokens": r.max_tokens,
                     "completion_tokens": r.completion_tokens, "target_passes": r.target_passes, "turn": r.turn,
                     "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                     "accepted_prediction_tokens": r.accepted_prediction_tokens,
                     "rejected_prediction_tokens": r.rejected_prediction_tokens,
                     "chunks": len(r.chunks), "ttft_s": r.chunks[0][0] - r.sent if r.chunks else None,
                     "e2e_s": r.done - r.sent, "finish_reason": r.finish_reason, "error": r.error, "text": r.text}
                    for r in requests],
    }


def _hit_rate(requests: list[Request]) -> float | None:
    prompt = sum(r.prompt_tokens for r in requests)
    return sum(r.cached_tokens for r in requests) / prompt if prompt else None


def compare_with_plain(rows: list[dict]) -> None:
    """Fill in each row's ``speedup`` and ``mismatches`` against ``none``'s row at its concurrency."""
    plain = {r["concurrency"]: r for r in rows if r["drafter"] == PLAIN}
    for row in rows:
        base = plain.get(row["concurrency"])
        if base is None:
            continue
        if base["tokens_per_second"]:
            row["speedup"] = row["tokens_per_second"] / base["tokens_per_second"]
        texts = {r["index"]: r["text"] for r in base["records"] if r["error"] is None}
        row["mismatches"] = sum(1 for r in row["records"] if r["index"] in texts and r["text"] != texts[r["index"]])


# -- servers ----------------------------------------------------------------------------------


def _wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = START_TIMEOUT_S) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SpecdraftError(f"the server stopped (exit status {proc.returncode}) before answering /health")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SpecdraftError(f"{url}/health did not answer within {timeout:.0f} s")


@contextmanager
def start_server(args, label: str, drafter: str, options: dict[str, str], log_path: Path) -> Iterator[str]:
    """``specdraft serve`` for ``drafter`` on a free port of 127.0.0.1, stderr to ``log_path``;
    yields its URL once /health answers, and stops it (Ctrl-C, then kill) afterwards."""
    command = [sys.executable, "-m", "specdraft.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--drafter", drafter, "--spec-length", str(args.spec_length), "--max-batch", str(args.max_batch),
               "--max-waiting", str(max(64, *args.levels))]
    command += [a for key, value in options.items() for a in ("--drafter-option", f"{key}={value}")]
    command += [a for lab, flag, value in args.server_options if lab == label for a in (f"--{flag}", value)]
    for flag in ("target", "dtype", "device", "quantize"):
        if getattr(args, flag) is not None:
            command += [f"--{flag}", str(getattr(args, flag))]
    if args.compile is not None:
        command.append("--compile" if args.compile else "--no-compile")
    if args.tensor_parallel != 1:
        command += ["--tensor-parallel", str(args.tensor_parallel)]
    log = open(log_path, "w")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines: queue.SimpleQueue = queue.SimpleQueue()

        def read_stdout() -> None:  # the ready line, then None when the server exits
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read_stdout, daemon=True).start()
        try:
            ready = lines.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            ready = None
        if not ready or " on http://" not in ready:
            proc.kill()
            proc.wait()
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-5:]).strip()
            raise SpecdraftError(f"`specdraft serve --drafter {drafter}` did not start (see {log_path}): {tail}")
        url = ready.rsplit(" ", 1)[1].strip()
        _wait_healthy(url, proc)
        print(f"bench-serve: {label} serving on {url}", file=sys.stderr)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


# -- continuous batching against fixed-batch waves --------------------------------------------


def _together(decoder, jobs: list[tuple[list[int], int]]) -> list:
    """Submit every ``(prompt_ids, max_new_tokens)`` at once; wait for all; their results."""
    streams = [decoder.stream_ids(ids, max_new_tokens=limit) for ids, limit in jobs]
    for stream in streams:
        for _ in stream:
            pass
    return [stream.result for stream in streams]


def fixed_batch_comparison(args, questions: list[dict], methods: dict[str, str],
                           options: dict[str, dict[str, str]]) -> dict:
    """Waves of ``--max-batch`` (each after the previous has finished) against all at once."""
    from ..decoder import SpeculativeDecoder
    from ..models import load_target

    model, tokenizer, name = load_target(args.target, dtype=args.dtype, device=args.device)
    rng = random.Random(0)
    low, high = max(1, args.max_tokens // 8), 2 * args.max_tokens
    chosen = questions[:args.fixed_batch]
    limits = [rng.randint(low, high) for _ in chosen]
    rows = []
    for label, drafter in methods.items():
        decoder = SpeculativeDecoder(model, tokenizer, drafter=drafter, spec_length=args.spec_length,
                                     drafter_options=options.get(label), compile=args.compile,
                                     quantize=args.quantize, max_batch=args.max_batch,
                                     tensor_parallel=args.tensor_parallel)
        jobs = [(decoder.encode(q["prompt"]), limit) for q, limit in zip(chosen, limits)]
        modes = {"waves": lambda: [r for i in range(0, len(jobs), args.max_batch)
                                   for r in _together(decoder, jobs[i:i + args.max_batch])],
                 "continuous": lambda: _together(decoder, jobs)}
        times: dict[str, list[float]] = {"waves": [], "continuous": []}
        outputs = []
        with decoder:
            decoder.warm_up(args.max_batch)
            _together(decoder, [(ids, 4) for ids, _ in jobs[:args.max_batch]])  # warm-up, not counted
            for mode in ORDER:
                start = time.perf_counter()
                outputs.append(modes[mode]())
                times[mode].append(time.perf_counter() - start)
        tokens = sum(len(r.token_ids) for r in outputs[0])
        row = {"drafter": label, "output_tokens": tokens}
        for mode, runs in times.items():  # every run of a mode has the same tokens (greedy)
            row[mode] = {"time_s": sum(runs) / len(runs), "runs_s": runs,
                         "tokens_per_second": tokens * len(runs) / sum(runs)}
        row["continuous_over_waves"] = sum(times["waves"]) / sum(times["continuous"])
        row["mismatches"] = sum(a.token_ids != b.token_ids for out in outputs[1:] for a, b in zip(outputs[0], out))
        rows.append(row)
    return {"requests": len(chosen), "max_batch": args.max_batch, "max_tokens": limits,
            "max_tokens_range": [low, high], "model": name, "rows": rows}


# -- report -----------------------------------------------------------------------------------


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else f"{value:{spec}}"


def _pair(d: dict, spec: str) -> str:
    return f"{_fmt(d['p50'], spec)} / {_fmt(d['p90'], spec)}"


def _gap_pair(gaps: dict | None) -> str:
    if not gaps:
        return "-"
    return f"{_fmt(gaps['p90'], '.0f')} / {_fmt(gaps['max'], '.0f')}"


def _prediction(row: dict) -> str:
    accepted, rejected = row.get("accepted_prediction_tokens", 0), row.get("rejected_prediction_tokens", 0)
    return f"{accepted} / {rejected}" if accepted or rejected else "-"


def markdown(results: dict) -> str:
    lines = ["# specdraft bench-serve", ""]
    lines += [f"- {k}: {v}" for k, v in results["environment"].items()]
    lines += ["", "## Streaming chat completions under load", "",
              "| drafter | concurrency | finished | tokens/s | speedup | TTFT p50 / p90 (ms) | ITL p50 / p90 (ms) "
              "| chunk gap p90 / max (ms) | e2e p50 / p90 (s) | tokens/pass | prediction accepted / rejected "
              "| mismatches |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["load"]:
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['drafter']} | {r['concurrency']} | {r['finished']}/{r['requests']} "
                     f"| {r['tokens_per_second']:.1f} | {speedup} | {_pair(r['ttft_ms'], '.0f')} "
                     f"| {_pair(r['itl_ms'], '.1f')} | {_gap_pair(r.get('gap_ms'))} | {_pair(r['e2e_s'], '.2f')} | {_fmt(r['tokens_per_pass'], '.2f')} "
                     f"| {_prediction(r)} | {_fmt(r['mismatches'], 'd')} |")
    turns = [r for r in results["load"] if r.get("later_turns_ttft_ms", {}).get("p50") is not None]
    if turns:
        lines += ["", "## Multi-turn conversations: the prefix cache", "",
                  "| drafter | concurrency | hit rate, turns 2+ | TTFT p50 / p90, first turns (ms) "
                  "| TTFT p50 / p90, later turns (ms) | tokens/s | mismatches |", "|---|---|---|---|---|---|---|"]
        for r in turns:
            rate = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
            lines.append(f"| {r['drafter']} | {r['concurrency']} | {rate} | {_pair(r['first_turn_ttft_ms'], '.0f')} "
                         f"| {_pair(r['later_turns_ttft_ms'], '.0f')} | {r['tokens_per_second']:.1f} "
                         f"| {_fmt(r['mismatches'], 'd')} |")
    fixed = results.get("fixed_batch")
    if fixed:
        low, high = fixed["max_tokens_range"]
        lines += ["", f"## Continuous batching against fixed-batch waves ({fixed['requests']} requests, max_tokens "
                      f"{low} to {high}, batches of {fixed['max_batch']})", "",
                  "| drafter | output tokens | waves: s (mean of 2) | waves: tokens/s | continuous: s (mean of 2) | continuous: tokens/s "
                  "| continuous / waves | mismatches |", "|---|---|---|---|---|---|---|---|"]
        for r in fixed["rows"]:
            lines.append(f"| {r['drafter']} | {r['output_tokens']} | {r['waves']['time_s']:.1f} "
                         f"| {r['waves']['tokens_per_second']:.1f} | {r['continuous']['time_s']:.1f} "
                         f"| {r['continuous']['tokens_per_second']:.1f} | {r['continuous_over_waves']:.2f}x "
                         f"| {r['mismatches']} |")
    return "\n".join(lines) + "\n"


def environment(args, model: str, questions: list[dict] | None = None) -> dict:
    from .. import __version__

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": model,
        "machine": f"{cpu}, {os.cpu_count()} cores",
        "server": args.url or f"specdraft serve --max-batch {args.max_batch} --spec-length {args.spec_length}"
                              + (" --compile" if args.compile else "") + (f" --quantize {args.quantize}" if args.quantize else ""),
        "questions": args.questions,
        "max_tokens": args.max_tokens,
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "drafters": args.drafters,
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts or "2 x concurrency, at least 8",
        "versions": f"specdraft {__version__}, python {platform.python_version()}",
    }
    predicted = sum(q.get("prediction") is not None for q in questions or [])
    if predicted:
        env["predictions"] = (f"{predicted} of {len(questions)} prompts carry a prediction, sent to the drafters' "
                              f"servers (not to {PLAIN})")
    return env


# -- the command ------------------------------------------------------------------------------


def _round_robin(questions: list[dict]) -> list[dict]:
    """The questions interleaved by category (one of each in turn), so any first N mix them."""
    by_category: dict[str, list[dict]] = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    columns = list(by_category.values())
    return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]


def requests_for(label: str, questions: list[dict], n: int, max_tokens: int, multi_turn: bool = False) -> list[Request]:
    """The first ``n`` questions as ``label``'s requests: with their predictions, except for ``none``;
    with ``multi_turn``, a request per turn of each (indexes numbered on across conversations)."""
    if not multi_turn:
        return [Request(i, q["question_id"], q["prompt"], max_tokens,
                        prediction=None if label == PLAIN else q.get("prediction"), tools=q.get("tools"),
                        tool_choice=q.get("tool_choice"))
                for i, q in enumerate(questions[:n])]
    requests: list[Request] = []
    for q in questions[:n]:
        first = len(requests)
        requests += [Request(first + t, q["question_id"], turn, max_tokens, system=q.get("system"), turn=t)
                     for t, turn in enumerate(q["turns"])]
    return requests


def _token_counter(target: str | None) -> Callable[[str], int]:
    """Tokens in a piece of text, by the target's tokenizer."""
    from transformers import AutoTokenizer

    from ..models import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(target)[1])
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def _check(args) -> tuple[dict[str, str], dict[str, dict[str, str]], list[dict], list[int]]:
    """Everything that can fail before a model loads: ``(methods, options, questions, where each
    level's questions start)``."""
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecdraftError(f"bench-serve needs {', '.join(missing)}: pip install 'specdraft[serve]' httpx")
    resolve_methods(args, f"{PLAIN},prompt-lookup", always="" if args.url else PLAIN)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise ConfigError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    if not args.levels or min(args.levels) < 1:
        raise ConfigError("--concurrency needs client counts >= 1")
    for name in ("max_tokens", "max_batch", "spec_length"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ConfigError("--num-prompts must be >= 1")
    if args.fixed_batch < 0:
        raise ConfigError("--fixed-batch must be >= 0")
    methods = dict(split_method(d.strip()) for d in args.drafters.split(",") if d.strip())
    if not methods:
        raise ConfigError("--drafters names no drafter")
    if args.url and len(methods) != 1:
        raise ConfigError("with --url, --drafters names the one drafter that server runs")
    options: dict[str, dict[str, str]] = {}
    for label, key, value in args.drafter_options:
        options.setdefault(label, {})[key] = value
    unknown = sorted(set(options) - set(methods))
    if unknown:
        raise ConfigError(f"--drafter-option names {', '.join(unknown)}, which --drafters does not run")
    unknown = sorted({label for label, _, _ in args.server_options} - set(methods))
    if unknown:
        raise ConfigError(f"--server-option names {', '.join(unknown)}, which --drafters does not run")
    if args.url and args.server_options:
        raise ConfigError("--server-option sets a server bench-serve starts; with --url, start it with those flags")
    from ..plugins import get_registry

    for label, drafter in methods.items():
        get_registry().validate_options(drafter, options.get(label))
    questions = _round_robin(load_questions(args.questions))
    return methods, options, questions, _level_starts(args, len(questions))


def _per_level(args, level: int) -> int:
    """Requests (conversations, with --multi-turn) sent at concurrency ``level``."""
    return args.num_prompts or max(8, 2 * level)


def _level_starts(args, available: int) -> list[int]:
    """Where each level's questions start: at 0 for every level, or with --multi-turn after the
    conversations of the levels before (a conversation sent again would find its every turn in
    the prefix cache, which no client does); ConfigError when the file has too few."""
    counts = [_per_level(args, level) for level in args.levels]
    if not args.multi_turn:
        return [0] * len(counts)
    if sum(counts) > available:
        raise ConfigError(f"--multi-turn sends each level conversations of its own: {sum(counts)} for levels "
                          f"{args.concurrency} ({', '.join(map(str, counts))}), but --questions has {available}; "
                          "write more (python -m specdraft.bench.workloads --multi-turn N) or lower --num-prompts")
    return [sum(counts[:i]) for i in range(len(counts))]


def bench_serve(args) -> int:
    methods, options, questions, starts = _check(args)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    count_tokens = _token_counter(args.target)
    rows: list[dict] = []
    with ExitStack() as stack:
        if args.url:
            _wait_healthy(args.url.rstrip("/"))
            urls = {next(iter(methods)): args.url.rstrip("/")}
        else:  # every server up at once (idle ones wait without using the CPU)
            urls = {label: stack.enter_context(start_server(args, label, drafter, options.get(label, {}),
                                                            out / f"server-{label}.log"))
                    for label, drafter in methods.items()}
        import httpx

        model = httpx.get(f"{next(iter(urls.values()))}/v1/models", timeout=30).json()["data"][0]["id"]
        for label, url in urls.items():  # warm-up, not counted (no predictions)
            run_level(url, [Request(i, q["question_id"], q["prompt"], 8)
                            for i, q in enumerate(questions[:min(args.max_batch, max(args.levels))])],
                      min(args.max_batch, max(args.levels)))
        for level, first in zip(args.levels, starts):
            for label, url in urls.items():
                requests = requests_for(label, questions[first:], _per_level(args, level), args.max_tokens,
                                        args.multi_turn)
                wall = run_level(url, requests, level)
                rows.append(summarize_level(label, level, requests, wall, count_tokens))
                r = rows[-1]
                print(f"bench-serve: {label} at concurrency {level}: {r['finished']}/{r['requests']} finished, "
                      f"{r['tokens_per_second']:.1f} tokens/s", file=sys.stderr)
    compare_with_plain(rows)
    sent = questions[:max(first + _per_level(args, level) for level, first in zip(args.levels, starts))]
    results = {"environment": environment(args, model, sent), "load": rows}
    if args.fixed_batch:
        print(f"bench-serve: fixed-batch waves against continuous batching, {args.fixed_batch} requests",
              file=sys.stderr)
        results["fixed_batch"] = fixed_batch_comparison(args, questions, methods, options)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}", file=sys.stderr)
    failed = sum(r["requests"] - r["finished"] for r in rows)
    if failed:
        raise SpecdraftError(f"{failed} requests did not finish: {'; '.join(e for r in rows for e in r['errors'])}")
    return 0
