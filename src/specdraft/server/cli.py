"""``specdraft serve``: load a decoder and serve it over HTTP with uvicorn.

Nothing heavy is imported until :func:`serve` runs, so ``specdraft --help`` stays instant;
without the ``serve`` extra, ``serve`` says in one line what to install.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import ipaddress
import math
import os
import signal
import socket
import sys

from ..errors import ConfigError, SpecdraftError
from ..tools import PARSERS
from ..types import LOGPROBS_MODES

#: the extra's modules (pip names differ only for prometheus_client's dash)
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")
#: seconds running requests get to finish after SIGTERM or Ctrl-C (``--drain-timeout``)
DRAIN_TIMEOUT_S = 10.0
#: seconds, once the drain is over, that connections get to send their last event before they are cut
GRACEFUL_SHUTDOWN_S = 5
#: connections the kernel queues before the server accepts them (also while the model loads)
LISTEN_BACKLOG = 2048
#: seconds a connection may stay idle after an answer (``--timeout-keep-alive``; uvicorn's default)
KEEP_ALIVE_S = 5.0
#: seconds a client has to send a request's headers and body (``--read-timeout``)
READ_TIMEOUT_S = 30.0
#: connections and requests at once (``--limit-concurrency``)
LIMIT_CONCURRENCY = 512
#: bytes of a request's line and headers buffered while incomplete (``--h11-max-incomplete-event-size``;
#: h11's default)
MAX_HEADER_BYTES = 16 * 1024
#: bytes of a request's body (``--max-request-bytes``; ``app.DEFAULT_MAX_REQUEST_BYTES``)
MAX_REQUEST_BYTES = 8 * 1024 * 1024


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``specdraft`` command's subparsers."""
    from ..cli_args import decoder_args, device_args

    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve the target with speculative decoding over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics); see docs/serving.md. "
                    "Needs pip install 'specdraft[serve]'.")
    p.add_argument("model", nargs="?", default=None,
                   help="the target, as --target (vLLM's `vllm serve MODEL`): a hub id, folder or .gguf file, or a "
                        "speculators checkpoint, served as its verifier with the checkpoint as the drafter")
    decoder_args(p)
    device_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for every interface (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 = any free port (default: 8000)")
    p.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int, default=8, metavar="N",
                   help="requests decoded together in one batch (vLLM: --max-num-seqs; default: 8)")
    p.add_argument("--max-waiting", type=int, default=64, metavar="N",
                   help="requests that may wait for a place in the batch (new ones wait until the engine's "
                        "next step); more get HTTP 429 (default: 64)")
    p.add_argument("--chunked-prefill-size", type=int, default=256, metavar="N",
                   help="prompt tokens per prefill pass: while others decode, a step prefills at most N, so a long "
                        "prompt joining delays the running streams' next tokens by one such pass, not its whole "
                        "prefill; 0 = each prompt in one pass (a chat's earlier turns end passes of their own: "
                        "docs/algorithm.md#prefix-caching) (SGLang's name; default: %(default)s)")
    p.add_argument("--prefix-caching", "--enable-prefix-caching", dest="prefix_caching",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="keep prompts' prefill passes and copy them into later prompts that begin with the same "
                        "tokens, output unchanged bit for bit (usage.prompt_tokens_details.cached_tokens; "
                        "docs/serving.md); --no-prefix-caching (vLLM: --no-enable-prefix-caching) turns it off "
                        "(default: on)")
    p.add_argument("--prefix-cache-memory", default="1GiB", metavar="SIZE",
                   help="the most memory the prefix cache's blocks take beside the running requests' KV cache, "
                        "least recently used blocks evicted past it: bytes, or 512MiB, 2GB, ... (default: %(default)s)")
    p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", default="4GiB",
                   metavar="SIZE",
                   help="the most memory the running requests' KV cache takes (per device): each request reserves "
                        "room for its prompt and max_tokens, new ones wait while the reservations fill it, and one "
                        "that could never fit gets a 400; what is allocated grows with use up to it: bytes, or 8GiB, "
                        "... (vLLM: --kv-cache-memory-bytes; default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", default=None, metavar="F",
                   help="vLLM's flag, refused: give the KV cache's size with --kv-cache-memory")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="the chat template to render messages with, in place of the tokenizer's: 'hermes' "
                        "(specdraft's ChatML template with tools, Hermes-style calls), a file, or Jinja text (vLLM's "
                        "flag; default: the tokenizer's)")
    p.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                   help="how tool_choice 'auto' reads calls out of the model's text: hermes (<tool_call>{...}"
                        "</tool_call>), llama3_json ({\"name\": ..., \"parameters\": ...}) (vLLM's flag; default: "
                        "the one the chat template's call format needs, if it has one)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: specdraft answers tool_choice 'auto' whenever it knows "
                        "the model's call format (--tool-call-parser or the chat template)")
    p.add_argument("--api-key", default=os.environ.get("SPECDRAFT_API_KEY") or None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every path but /health and /metrics (/v1, /tokenize, "
                        "/detokenize, /docs, /openapi.json) (default: $SPECDRAFT_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: the target's name)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                   help="on SIGTERM or Ctrl-C: new requests get 503, waiting ones end with a 503 at once, running "
                        "ones get up to S seconds to finish, then end with a 503 (a stream: an error event, then "
                        "[DONE]); a second signal ends them at once (default: %(default)g)")
    p.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S, metavar="S",
                   help="close a connection idle for S seconds after an answer (default: %(default)g)")
    p.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S, metavar="S",
                   help="a client must send a request's headers and body within S seconds of connecting (or of "
                        "its previous answer), else 408 and the connection is closed; 0 = no limit "
                        "(default: %(default)g)")
    p.add_argument("--limit-concurrency", type=int, default=LIMIT_CONCURRENCY, metavar="N",
                   help="at most N open connections and requests; requests beyond that get 503 at once "
                        "(default: %(default)d)")
    p.add_argument("--h11-max-incomplete-event-size", type=int, default=MAX_HEADER_BYTES, metavar="N",
                   help="bytes of a request's line and headers buffered while they are incomplete; beyond that, "
                        "400 and the connection is closed (uvicorn's option; default: %(default)d)")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, metavar="N",
                   help="a request's body may take at most N bytes, else 413 (default: %(default)d, 8 MiB)")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="processed",
                   help="what the log-probabilities requests ask for (logprobs, top_logprobs) are computed from: "
                        "processed = the distribution each token was drawn from (after penalties, temperature, "
                        "top-k/top-p/min-p; greedy: the penalized logits), raw = the model's own logits "
                        "(vLLM's names; default: %(default)s)")
    return p


def _check_extra() -> None:
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecdraftError(f"specdraft serve needs {', '.join(missing)}; install the server's dependencies "
                             "with: pip install 'specdraft[serve]'")


def _check_process_args(args) -> None:
    """The server process's limits (before anything loads)."""
    for name, low in (("drain_timeout", 0.0), ("timeout_keep_alive", 0.0), ("read_timeout", 0.0)):
        value = getattr(args, name)
        if not math.isfinite(value) or value < low or (name == "timeout_keep_alive" and value == 0):
            bound = "> 0" if name == "timeout_keep_alive" else ">= 0"
            raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds {bound} (got {value:g})")
    if args.limit_concurrency < 1:
        raise ConfigError(f"--limit-concurrency must be >= 1 (got {args.limit_concurrency})")
    if args.h11_max_incomplete_event_size < 1024:
        raise ConfigError(f"--h11-max-incomplete-event-size must be >= 1024: clients send more than that in "
                          f"ordinary headers (got {args.h11_max_incomplete_event_size})")
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be >= 1 (got {args.max_request_bytes})")


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound and listening before the model loads, so a taken port fails at
    once (connections made while the model loads wait in the backlog)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be from 0 to 65535 (got {port})")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} is not an address this machine can listen on ({exc.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)  # bound alone, a port another server also bound (SO_REUSEADDR) still fails later
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port "
                          "(0 = any free port)") from None
    sock.set_inheritable(True)
    return sock


def _open_without_key(sock: socket.socket, api_key: str | None) -> str | None:
    """The warning for a server on a non-loopback address without an API key (None: no warning)."""
    if api_key:
        return None
    host = sock.getsockname()[0]
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    if address.is_loopback or (address.version == 6 and address.ipv4_mapped is not None
                               and address.ipv4_mapped.is_loopback):
        return None
    where = "every interface" if address.is_unspecified else host
    return (f"specdraft: warning: serving on {where} without --api-key: anyone who can reach this port can use it "
            "and read /docs")


def serve(args) -> int:
    """Load the decoder ``args`` describe and serve it until SIGTERM or Ctrl-C, which drain it
    (:mod:`.process`): 0 after SIGTERM, 130 after Ctrl-C once the server has stopped."""
    _check_extra()
    from ..cli_args import resolve_drafter
    from ..limits import check_spec_length
    from ..plugins import get_registry

    # Cheap checks first, so a typo fails in a blink rather than after loading a model.
    if args.model is not None:
        if args.target is not None and args.target != args.model:
            raise ConfigError(f"the model is given twice, as {args.model!r} and as --target {args.target!r}; give "
                              "one")
        args.target = args.model
    resolve_drafter(args)
    check_spec_length(args.spec_length)
    if args.max_batch < 1:
        raise ConfigError("--max-batch must be >= 1")
    if args.max_waiting < 1:  # a new request waits until the engine's next step takes it in
        raise ConfigError("--max-waiting must be >= 1: every request waits for the engine's next step")
    if args.chunked_prefill_size < 0:
        raise ConfigError("--chunked-prefill-size must be >= 0 (0: each prompt in one pass)")
    from ..engine.prefix import parse_memory

    try:
        prefix_memory = parse_memory(args.prefix_cache_memory)
    except ConfigError as exc:
        raise ConfigError(f"--prefix-cache-memory: {exc}") from None
    if args.gpu_memory_utilization is not None:
        raise ConfigError("--gpu-memory-utilization is vLLM's; specdraft sizes the running requests' KV cache with "
                          "--kv-cache-memory SIZE (per device, e.g. 40GiB; default 4GiB)")
    from ..engine.memory import check_kv_memory

    try:
        kv_memory = check_kv_memory(args.kv_cache_memory)
    except ConfigError as exc:
        raise ConfigError(f"--kv-cache-memory: {exc}") from None
    _check_process_args(args)
    if args.chat_template is not None:
        from ..tools import load_chat_template

        try:
            load_chat_template(args.chat_template)
        except ConfigError as exc:
            raise ConfigError(f"--chat-template: {exc}") from None
    get_registry().validate_options(args.drafter, dict(args.drafter_options))
    sock = _bind(args.host, args.port)
    warning = _open_without_key(sock, args.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    try:
        from ..decoder import SpeculativeDecoder

        decoder = SpeculativeDecoder.from_pretrained(
            target=args.target, drafter=args.drafter, spec_length=args.spec_length,
            drafter_options=dict(args.drafter_options), dtype=args.dtype, device=args.device,
            adaptive=not args.fixed_spec_length, compile=args.compile, quantize=args.quantize,
            max_batch=args.max_batch, max_waiting=args.max_waiting, prefill_chunk=args.chunked_prefill_size,
            tensor_parallel=args.tensor_parallel, prefix_caching=args.prefix_caching, prefix_cache_memory=prefix_memory,
            kv_cache_memory=kv_memory,
            chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
        )
        import uvicorn

        from .app import create_app
        from .process import make_server

        app = create_app(decoder, model_name=args.served_model_name, api_key=args.api_key,
                         max_request_bytes=args.max_request_bytes, logprobs_mode=args.logprobs_mode)
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        ready = (f"specdraft: serving {app.state.model_name} with drafter {decoder.drafter.name or args.drafter} "
                 f"on http://{url_host}:{port}")
        log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)  # the server's own errors print like uvicorn's
        log_config["loggers"]["specdraft"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
        log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # stdout: only the ready line
        server = make_server(app, decoder, drain_timeout=args.drain_timeout, read_timeout=args.read_timeout,
                             timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
                             max_header_bytes=args.h11_max_incomplete_event_size,
                             graceful_shutdown=GRACEFUL_SHUTDOWN_S, backlog=LISTEN_BACKLOG, ready=ready,
                             log_config=log_config)
        server.run(sockets=[sock])
    finally:
        sock.close()
    # uvicorn raises a caught Ctrl-C again once stopped, but a process started with SIGINT ignored
    # (a background job of a shell without job control) would swallow it and exit 0: say 130 here.
    return 130 if signal.SIGINT in server._captured_signals else 0

