"""The OpenAI-compatible HTTP API over a :class:`~specdraft.SpeculativeDecoder`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with server-sent-event streaming), ``POST /tokenize`` and ``POST /detokenize`` (vLLM's),
``GET`` / ``HEAD /health`` and ``GET /metrics`` (Prometheus).

The decoder's engine decodes in its own thread; this app only submits requests
(``decoder.stream_ids``, prompts encoded in at most :data:`BLOCKING_THREADS` worker threads) and
reads their streams on the event loop (:mod:`.outputs`: no thread per stream), so the event
loop never waits on the model. Every error is OpenAI's JSON
``{"error": {"message", "type", "param", "code"}}`` with a one-line message: 400 bad
parameters (an unknown one included), 401 a missing or wrong API key, 404 an unknown model or
path, 413 a body over ``max_request_bytes``, 415 a body that is not ``application/json``, 429 a
full queue (with ``Retry-After``), 500 a failed drafter or anything unexpected (logged here with
its traceback).
"""

from __future__ import annotations

import hmac
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import ConfigError
from ..limits import chars_per_token, check_fits
from ..settings import GenerationSettings
from ..types import LOGPROBS_MODES, TargetInfo
from .bodies import DEFAULT_MAX_REQUEST_BYTES
from .chat import ChatCompletion
from .completions import Completion
from .errors import APIError, as_api_error, body_errors, invalid
from .logprobs import TokenTexts
from .metrics import ServerMetrics
from .outputs import OutputLoop
from .protocol import ModelCard, ModelList
from .serving import GeneratingRoutes
from .tokenize import TokenizeRoutes


#: worker threads that encode prompts and submit requests (blocking work) at once; streams take none
BLOCKING_THREADS = 4
#: paths served without the API key (as in vLLM): load balancers and Prometheus probe them
OPEN_PATHS = ("/health", "/metrics")


class _APIKeyMiddleware:
    """401 for requests without ``Authorization: Bearer <key>``: every path (``/v1/...``,
    ``/tokenize``, ``/detokenize``, ``/docs``, ``/redoc``, ``/openapi.json``) but ``OPEN_PATHS``
    (``/health`` and ``/metrics``, as in vLLM). Plain ASGI, so it never wraps a stream's ``receive``."""

    def __init__(self, app, api_key: str, metrics: ServerMetrics) -> None:
        self.app, self.key, self.metrics = app, api_key.encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope.get("method") != "OPTIONS":
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                self.metrics.error(401)
                error = APIError(401, "missing or wrong API key: send the server's key (its --api-key) as "
                                      "`Authorization: Bearer KEY`", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ServedDecoder(Protocol):
    """What the server uses of its decoder (:class:`~specdraft.SpeculativeDecoder`; the tests' stand-in
    has the same): the target's description, the tokenizer (None: token ids only), prompt encoding,
    submitting a request, the queue's sizes and ending requests at shutdown. With ``observe`` and
    ``kv_cache_usage`` too, the metrics count as the engine steps (:class:`.metrics.SteppingDecoder`)."""

    target: TargetInfo
    tokenizer: Any

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def encode(self, prompt: str, raw: bool = False) -> list[int]: ...

    def encode_chat(self, messages, chat_template_kwargs=None, *, add_special_tokens: bool = False,
                    check_text=None, tools=None) -> list[int]: ...  # tools: given only with a request's tools

    def stream_ids(self, prompt_ids, settings: GenerationSettings): ...

    def end_requests(self, error: BaseException, *, running: bool = True) -> int: ...

    def close(self) -> None: ...


class _Server(GeneratingRoutes, TokenizeRoutes):
    """One app's state (the decoder, the name it is served as, the metrics) and its routes, which
    :meth:`register` adds to the app: the generating ones (:mod:`.serving`, with :mod:`.completions`
    and :mod:`.chat` shaping each route's request and answer), vLLM's ``/tokenize`` and
    ``/detokenize`` (:mod:`.tokenize`), and here ``/v1/models``, ``/health`` and ``/metrics``."""

    def __init__(self, decoder: ServedDecoder, served: str, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 logprobs_mode: str = "processed") -> None:
        self.decoder, self.served, self.metrics = decoder, served, ServerMetrics(decoder, served)
        self.max_request_bytes = max_request_bytes
        self.logprobs_mode = logprobs_mode  # what requests' log-probabilities are computed from
        # the most characters one token covers (None: no sound bound; see .limits), read once here
        tokenizer = decoder.tokenizer
        self.chars_per_token = None if tokenizer is None else chars_per_token(tokenizer)
        self.token_texts = None if tokenizer is None else TokenTexts(tokenizer)  # tokens' texts, for logprobs
        self._limiter: anyio.CapacityLimiter | None = None  # made on first use, inside the event loop
        self.outputs = OutputLoop()  # reads every request's stream (see .outputs)

    def register(self, app: FastAPI) -> None:
        for exc_class in (APIError, Exception):
            app.add_exception_handler(exc_class, self._on_error)
        app.add_exception_handler(RequestValidationError, self._on_invalid_body)
        app.add_exception_handler(StarletteHTTPException, self._on_http_error)
        app.get("/health")(self.health)
        app.head("/health", include_in_schema=False)(self.health)  # load balancers probe with HEAD
        app.get("/metrics")(self.prometheus_metrics)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)

    # -- routes (their names are the OpenAPI operation ids) ---------------------------------

    @staticmethod
    async def health() -> dict:
        return {"status": "ok"}

    async def prometheus_metrics(self) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict:
        target = self.decoder.target
        card = ModelCard(id=self.served, root=target.name or self.served, max_model_len=target.max_context)
        return ModelList(data=[card]).model_dump()

    async def completions(self, request: Request):
        return await self.generate(request, Completion)

    async def chat_completions(self, request: Request):
        return await self.generate(request, ChatCompletion)

    def check_served(self, body) -> None:
        """404 unless the request names the served model (or none)."""
        if body.model is not None and body.model != self.served:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.served!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")

    async def blocking(self, func, *args):
        """``func(*args)`` in a worker thread (at most :data:`BLOCKING_THREADS` at once)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(BLOCKING_THREADS)
        return await anyio.to_thread.run_sync(func, *args, limiter=self._limiter)

    def tokenizer(self):
        """The decoder's tokenizer; APIError when it has none."""
        tokenizer = self.decoder.tokenizer
        if tokenizer is None:
            raise APIError(400, "this server's decoder has no tokenizer: it takes and returns token ids only")
        return tokenizer

    def check_length(self, text: str, param: str) -> None:
        """400 for a text whose length alone shows it has more tokens than the context holds,
        before anything tokenizes it (:func:`specdraft.limits.check_fits`)."""
        try:
            check_fits(text, param, self.chars_per_token, self.decoder.target.max_context)
        except ConfigError as exc:
            raise APIError(400, str(exc), param=param) from None

    # -- errors -----------------------------------------------------------------------------

    def error(self, exc: BaseException) -> APIError:
        """The APIError ``exc`` is answered with, counted in the metrics."""
        error = as_api_error(exc)
        self.metrics.error(error.status)
        return error

    async def _on_error(self, request: Request, exc: Exception) -> JSONResponse:
        return self.error(exc).response()

    async def _on_invalid_body(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        return self.error(invalid(body_errors(exc))).response()

    async def _on_http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{exc.detail}: {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        return self.error(APIError(exc.status_code, str(message), code=code)).response()


def create_app(decoder: ServedDecoder, *, model_name: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, logprobs_mode: str = "processed") -> FastAPI:
    """An OpenAI-compatible app serving ``decoder`` as ``model_name`` (default: the target's name).

    With ``api_key`` every request but ``/health`` and ``/metrics`` (``/v1/...``, ``/tokenize``,
    ``/detokenize``, ``/docs``, ``/redoc``, ``/openapi.json``) must send ``Authorization: Bearer
    <api_key>``. A request body over ``max_request_bytes`` is refused (413) before it is read whole.
    ``logprobs_mode``: what requests' log-probabilities are computed from, ``"processed"`` (the
    distribution each token was drawn from) or ``"raw"`` (the model's logits).
    """
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ConfigError(f"max_request_bytes must be an integer >= 1 (got {max_request_bytes!r})")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ConfigError(f"logprobs_mode must be one of {', '.join(map(repr, LOGPROBS_MODES))} "
                          f"(got {logprobs_mode!r})")
    server = _Server(decoder, model_name or decoder.target.name or "specdraft", max_request_bytes, logprobs_mode)
    app = FastAPI(title="specdraft", version=__version__,
                  description="OpenAI-compatible server of exact speculative decoding")
    app.state.decoder, app.state.metrics, app.state.model_name = decoder, server.metrics, server.served
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, metrics=server.metrics)
    server.register(app)
    return app

