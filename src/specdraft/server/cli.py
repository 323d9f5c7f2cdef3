"""``specdraft serve``: load a decoder and serve it over HTTP with uvicorn.

Nothing heavy is imported until :func:`serve` runs, so ``specdraft --help`` stays instant;
without the ``serve`` extra, ``serve`` says in one line what to install.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import socket

from ..errors import ConfigError, SpecdraftError

#: the extra's modules (pip names differ only for prometheus_client's dash)
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")
#: seconds a shutdown waits for open requests (streams) before closing them
GRACEFUL_SHUTDOWN_S = 5


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``specdraft`` command's subparsers."""
    from ..cli_args import decoder_args, device_args

    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve the target with speculative decoding over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics); see docs/serving.md. "
                    "Needs pip install 'specdraft[serve]'.")
    decoder_args(p)
    device_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for every interface (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 = any free port (default: 8000)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="requests decoded together in one batch (default: 8)")
    p.add_argument("--max-waiting", type=int, default=64, metavar="N",
                   help="requests that may wait for a place in the batch (new ones wait until the engine's "
                        "next step); more get HTTP 429 (default: 64)")
    p.add_argument("--api-key", default=os.environ.get("SPECDRAFT_API_KEY") or None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1 requests (default: $SPECDRAFT_API_KEY, "
                        "else no key)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: the target's name)")
    return p


def _check_extra() -> None:
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecdraftError(f"specdraft serve needs {', '.join(missing)}; install the server's dependencies "
                             "with: pip install 'specdraft[serve]'")


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a taken port fails at once."""
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
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port "
                          "(0 = any free port)") from None
    sock.set_inheritable(True)
    return sock


def serve(args) -> int:
    """Load the decoder ``args`` describe and serve it until Ctrl-C (or SIGTERM)."""
    _check_extra()
    from ..decoder import check_spec_length
    from ..plugins import get_registry

    # Cheap checks first, so a typo fails in a blink rather than after loading a model.
    check_spec_length(args.spec_length)
    if args.max_batch < 1:
        raise ConfigError("--max-batch must be >= 1")
    if args.max_waiting < 1:  # a new request waits until the engine's next step takes it in
        raise ConfigError("--max-waiting must be >= 1: every request waits for the engine's next step")
    get_registry().validate_options(args.drafter, dict(args.drafter_options))
    sock = _bind(args.host, args.port)
    try:
        from ..decoder import SpeculativeDecoder

        decoder = SpeculativeDecoder.from_pretrained(
            target=args.target, drafter=args.drafter, spec_length=args.spec_length,
            drafter_options=dict(args.drafter_options), dtype=args.dtype, device=args.device,
            adaptive=not args.fixed_spec_length, compile=args.compile, quantize=args.quantize,
            max_batch=args.max_batch, max_waiting=args.max_waiting,
        )
        import uvicorn

        from .app import create_app

        app = create_app(decoder, model_name=args.served_model_name, api_key=args.api_key)
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        ready = (f"specdraft: serving {app.state.model_name} with drafter {decoder.drafter.name or args.drafter} "
                 f"on http://{url_host}:{port}")

        class Server(uvicorn.Server):
            async def startup(self, sockets=None) -> None:
                await super().startup(sockets=sockets)
                if not self.should_exit:
                    print(ready, flush=True)

        log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)  # the server's own errors print like uvicorn's
        log_config["loggers"]["specdraft"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
        log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # stdout: only the ready line
        config = uvicorn.Config(app, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, log_level="info",
                                log_config=log_config)
        Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0

