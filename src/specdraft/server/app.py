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
import json
import logging
import re
import time
from typing import Any, AsyncIterator, Callable, Mapping

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import ConfigError, DrafterError, QueueFull, SpecdraftError, describe_validation_error
from ..limits import chars_per_token, check_fits
from ..sampling import SamplingParams
from ..types import LOGPROBS_MODES
from .logprobs import ChatFormat, CompletionFormat, StreamedLogprobs, TokenTexts
from .metrics import ServerMetrics
from .outputs import OutputLoop
from .protocol import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    CompletionTokensDetails,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    OpenAIBaseModel,
    SamplingRequest,
    SpecDecodeInfo,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UsageInfo,
    now,
    random_id,
)

logger = logging.getLogger("specdraft.server")

#: the engine's finish reasons as OpenAI's
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
#: worker threads that encode prompts and submit requests (blocking work) at once; streams take none
BLOCKING_THREADS = 4
#: the largest request body read (bytes; ``create_app(max_request_bytes=...)``, ``serve
#: --max-request-bytes``): 8 MiB holds a prompt far longer than any context (a token is a few
#: bytes of text), and caps what one request can make the server parse and tokenize
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
#: arrays and objects in a request body nest at most this deep (a real request nests 4 or 5)
MAX_JSON_DEPTH = 64
#: the ``Retry-After`` (seconds) of a 429: a place in the queue frees as soon as a request ends
RETRY_AFTER_SECONDS = 1
#: paths served without the API key (as in vLLM): load balancers and Prometheus probe them
OPEN_PATHS = ("/health", "/metrics")
#: chat roles a message may have; "developer" is passed to the template as "system"
CHAT_ROLES = ("system", "developer", "user", "assistant")


class APIError(Exception):
    """An error answered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, _one_line(message), type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _one_line(text: str) -> str:
    # lone surrogates (from a request's "\ud800") cannot be encoded as UTF-8: escaped
    return " ".join(str(text).encode("utf-8", "backslashreplace").decode("utf-8").split()) or "error"


def as_api_error(exc: BaseException) -> APIError:
    """The status and message a failure is answered with; logs the unexpected ones."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, ConfigError):
        return APIError(400, str(exc))
    if isinstance(exc, DrafterError):
        return APIError(500, str(exc), type="server_error", code="drafter_error")
    if isinstance(exc, SpecdraftError):
        return APIError(500, str(exc), type="server_error")
    logger.error("unexpected error while serving a request", exc_info=exc)
    first = (str(exc).strip().splitlines() or [""])[0]
    return APIError(500, f"internal error: {type(exc).__name__}{': ' + first if first else ''} (logged by the server)",
                    type="server_error", code="internal_error")


class _BodyErrors:
    """A RequestValidationError's errors with the leading ``body`` dropped from each location."""

    def __init__(self, exc: RequestValidationError) -> None:
        self._errors = [dict(e, loc=tuple(e.get("loc", ()))[1:] if tuple(e.get("loc", ()))[:1] == ("body",)
                             else tuple(e.get("loc", ()))) for e in exc.errors()]

    def errors(self) -> list[dict]:
        return self._errors


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


class _EventStreamResponse(StreamingResponse):
    """Server-sent events; ``on_exit()`` runs however the response ends. A client that goes away
    cancels the sending, and the events' generator may then sit unfinished at a ``yield`` (or
    never have started), where no ``finally`` of its own runs soon."""

    media_type = "text/event-stream"

    def __init__(self, content, on_exit) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_exit = on_exit

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_exit()


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` once the client goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _finish_reason(result) -> str:
    """The engine's finish reason as OpenAI's."""
    return FINISH_REASONS.get(result.finish_reason, result.finish_reason)


def _usage(streams: list, results: list) -> UsageInfo:
    """The usage of a request's choices (``streams``, their ``results``): the prompt once, the
    completions summed."""
    stream, result = streams[0], results[0]
    prompt = result.stats.prompt_tokens if result is not None else stream.prompt_tokens
    completion = sum(len(r.token_ids) for r in results if r is not None)
    details = None
    if stream.seq.prediction is not None:  # OpenAI's Predicted Outputs usage
        stats = result.stats if result is not None else stream.seq.stats
        details = CompletionTokensDetails(accepted_prediction_tokens=stats.accepted_prediction_tokens,
                                          rejected_prediction_tokens=stats.rejected_prediction_tokens)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     completion_tokens_details=details)


class _Reply:
    """What a generating route adds to the path both share (:meth:`_Server.generate`): how its
    request is read (the class) and how one request's answer is shaped (an instance, holding the
    answer's id, creation time and model).

    Subclasses define ``encoder(body, decoder, check_length)``, which checks the prompt and returns
    the function that encodes it (it may block: it runs in a worker thread; ``check_length(text,
    param)`` refuses a text too long for the context before it is tokenized), ``choice(text,
    finish_reason)``, the whole answer's choice, and ``stream_choice(text, finish_reason=None,
    logprobs=None)``, a streamed one (text None in the one that ends the stream).
    """

    request: type[SamplingRequest]
    prompt_param: str  # the parameter holding the prompt (named in a 400 for a prompt too long)
    id_prefix: str
    default_max_tokens: int
    response: type[OpenAIBaseModel]  # the whole answer
    stream_response: type[OpenAIBaseModel]  # one chunk of a streamed answer
    logprob_format: type  # log-probabilities in this route's shape (.logprobs)

    def __init__(self, model: str, texts: TokenTexts | None = None) -> None:
        self.id, self.created, self.model = random_id(self.id_prefix), now(), model
        #: the tokens' texts when the request asked for log-probabilities (None: it did not)
        self.texts = texts
        self._streamed: dict[int, tuple] = {}  # choice index -> (its logprob_format, its StreamedLogprobs)

    def whole_logprobs(self, result):
        """A whole choice's ``logprobs`` for ``result`` (None: not asked for)."""
        return None if self.texts is None else self.logprob_format(self.texts)(result.logprobs or [])

    def chunk_logprobs(self, chunk=None, index: int = 0):
        """Streamed choice ``index``'s ``logprobs`` for ``chunk`` (None: not asked for): of the
        tokens whose text the text sent so far completes (see :class:`.logprobs.StreamedLogprobs`),
        or, with no chunk (the chunk that ends the choice), of every token left."""
        if self.texts is None:
            return None
        if index not in self._streamed:
            self._streamed[index] = (self.logprob_format(self.texts), StreamedLogprobs(self.texts.tokenizer))
        shape, streamed = self._streamed[index]
        return shape(streamed.add(chunk) if chunk is not None else streamed.rest())

    @staticmethod
    def max_tokens(body) -> tuple[int | None, str]:
        """The requested completion length (None: ``default_max_tokens``) and the parameter that set it."""
        return body.max_tokens, "max_tokens"

    def opening(self, index: int = 0) -> list:
        """Choice ``index``'s streamed choices sent before its first token, one chunk each."""
        return []

    def whole(self, streams: list, results: list) -> dict:
        """The whole answer: a choice per result (``index`` in order)."""
        choices = []
        for index, result in enumerate(results):
            choice = self.choice(result.text or "", _finish_reason(result))
            choice.index, choice.logprobs = index, self.whole_logprobs(result)
            choices.append(choice)
        return self.response(id=self.id, created=self.created, model=self.model, choices=choices,
                             usage=_usage(streams, results),
                             spec_decode=SpecDecodeInfo.from_stats(*(r.stats for r in results))).model_dump()

    def event(self, choices: list, usage: UsageInfo | None = None, spec_decode: SpecDecodeInfo | None = None) -> str:
        """A stream chunk as OpenAI sends it: null fields left out, but every choice's finish_reason kept."""
        data = self.stream_response(id=self.id, created=self.created, model=self.model, choices=choices,
                                    usage=usage, spec_decode=spec_decode).model_dump(exclude_none=True)
        for choice in data.get("choices", []):
            choice.setdefault("finish_reason", None)
        return _sse(data)


class _Completion(_Reply):
    """``/v1/completions``: a raw prompt (text or token ids); a choice is the text."""

    request, response, stream_response = CompletionRequest, CompletionResponse, CompletionStreamResponse
    id_prefix, default_max_tokens, prompt_param = "cmpl", COMPLETION_DEFAULT_MAX_TOKENS, "prompt"
    logprob_format = CompletionFormat

    @staticmethod
    def encoder(body: CompletionRequest, decoder, check_length) -> Callable[[], list[int]]:
        prompt = _completion_prompt(body.prompt)
        if isinstance(prompt, list):
            return lambda: list(prompt)
        check_length(prompt, "prompt")
        return lambda: decoder.encode(prompt, raw=True)

    @staticmethod
    def choice(text: str, finish_reason: str) -> CompletionResponseChoice:
        return CompletionResponseChoice(text=text, finish_reason=finish_reason)

    @staticmethod
    def stream_choice(text: str | None, finish_reason: str | None = None,
                      logprobs=None) -> CompletionResponseStreamChoice:
        return CompletionResponseStreamChoice(text=text or "", finish_reason=finish_reason, logprobs=logprobs)


class _ChatCompletion(_Reply):
    """``/v1/chat/completions``: messages through the chat template; a choice is the assistant's
    message, streamed as deltas after one that gives the role."""

    request, response, stream_response = ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse
    id_prefix, default_max_tokens, prompt_param = "chatcmpl", CHAT_DEFAULT_MAX_TOKENS, "messages"
    logprob_format = ChatFormat

    @staticmethod
    def encoder(body: ChatCompletionRequest, decoder, check_length) -> Callable[[], list[int]]:
        messages = _chat_messages(body)
        options = _template_kwargs(body.chat_template_kwargs)
        return lambda: decoder.encode_chat(messages, options, check_text=lambda text: check_length(text, "messages"))

    @staticmethod
    def max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return body.requested_max_tokens, param

    @staticmethod
    def choice(text: str, finish_reason: str) -> ChatCompletionResponseChoice:
        return ChatCompletionResponseChoice(message=ChatMessage(content=text), finish_reason=finish_reason)

    @staticmethod
    def stream_choice(text: str | None, finish_reason: str | None = None, logprobs=None,
                      role: str | None = None) -> ChatCompletionResponseStreamChoice:
        return ChatCompletionResponseStreamChoice(delta=DeltaMessage(role=role, content=text),
                                                  finish_reason=finish_reason, logprobs=logprobs)

    def opening(self, index: int = 0) -> list:
        choice = self.stream_choice("", role="assistant")
        choice.index = index
        return [choice]


class _Server:
    """One app's state (the decoder, the name it is served as, the metrics) and its routes, which
    :meth:`register` adds to the app."""

    def __init__(self, decoder, served: str, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 logprobs_mode: str = "processed") -> None:
        self.decoder, self.served, self.metrics = decoder, served, ServerMetrics(decoder, served)
        self.max_request_bytes = max_request_bytes
        self.logprobs_mode = logprobs_mode  # what requests' log-probabilities are computed from
        # the most characters one token covers (None: no sound bound; see .limits), read once here
        tokenizer = getattr(decoder, "tokenizer", None)
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
        return await self.generate(request, _Completion)

    async def chat_completions(self, request: Request):
        return await self.generate(request, _ChatCompletion)

    async def tokenize(self, request: Request):
        """vLLM's ``/tokenize``: ``{"prompt"}`` as completions tokenize it, or ``{"messages"}`` as
        chat completions render and tokenize them; ``{"tokens", "count", "max_model_len"}``."""
        try:
            data = await _read_json(request, self.max_request_bytes)
            body = _validate(data, TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest)
            self.check_served(body)
            tokenizer = self.tokenizer()
            if isinstance(body, TokenizeChatRequest):
                messages = _chat_messages(body)
                options = {"add_generation_prompt": body.add_generation_prompt,
                           **_template_kwargs(body.chat_template_kwargs)}

                def encode() -> list[int]:
                    return self.decoder.encode_chat(messages, options, add_special_tokens=body.add_special_tokens,
                                                    check_text=lambda text: self.check_length(text, "messages"))
            else:
                self.check_length(body.prompt, "prompt")

                def encode() -> list[int]:
                    return list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)

            try:
                ids = await self.blocking(encode)
            except ConfigError as exc:
                raise APIError(400, str(exc), param=_config_param(exc, body, "messages")) from None
            return TokenizeResponse(count=len(ids), max_model_len=self.decoder.target.max_context,
                                    tokens=ids).model_dump()
        except Exception as exc:
            return self.error(exc).response()

    async def detokenize(self, request: Request):
        """vLLM's ``/detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
        try:
            body = await _parse(request, DetokenizeRequest, self.max_request_bytes)
            self.check_served(body)
            tokenizer = self.tokenizer()
            vocab = self.decoder.target.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"tokens holds {bad}, outside the vocabulary [0, {vocab}); send the model's "
                                    "token ids", param="tokens")
            text = await self.blocking(tokenizer.decode, body.tokens)
            return DetokenizeResponse(prompt=text).model_dump()
        except Exception as exc:
            return self.error(exc).response()

    def tokenizer(self):
        """The decoder's tokenizer; APIError when it has none."""
        tokenizer = getattr(self.decoder, "tokenizer", None)
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
        return self.error(_invalid(_BodyErrors(exc))).response()

    async def _on_http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{exc.detail}: {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        return self.error(APIError(exc.status_code, str(message), code=code)).response()

    # -- the generating path ----------------------------------------------------------------

    async def generate(self, request: Request, kind: type[_Reply]):
        """Both generating routes: the request submitted to the engine, then its answer streamed
        or read to the end; any failure before the answer starts is answered as an error."""
        try:
            body = await _parse(request, kind.request, self.max_request_bytes)
            started = time.monotonic()
            self.check_model(body)
            streams = await self.submit(body, kind)
            reply = kind(self.served, None if body.requested_logprobs() is None else self.token_texts)
            if body.stream:
                return self.event_stream(streams, started, reply, body.include_usage)
            results = []
            for i, stream in enumerate(streams):  # the choices run together; read in turn
                result = await self.run_to_end(request, stream, started)
                if result is None:
                    for other in streams[i + 1 :]:
                        self.abort(other, started)
                    return Response(status_code=204)  # nobody is listening
                results.append(result)
            return reply.whole(streams, results)
        except Exception as exc:
            return self.error(exc).response()

    def check_served(self, body) -> None:
        """404 unless the request names the served model (or none)."""
        if body.model is not None and body.model != self.served:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.served!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")

    def check_model(self, body: SamplingRequest) -> None:
        """The served model, no parameter specdraft cannot honour, and sampling settings in range
        (checked here, before the prompt is tokenized, so that the 400 names the parameter)."""
        self.check_served(body)
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, f"{bad}: not supported by specdraft's server"
                                + (" (only n=1)" if bad == "n" else ""), param=bad, code="unsupported_parameter")
        try:
            settings = body.sampling()
        except ConfigError as exc:  # a structured output field (response_format, guided_json, ...)
            raise APIError(400, str(exc), param=_config_param(exc, body, "prompt")) from None
        try:
            SamplingParams(**{k: v for k, v in settings.items() if k in SamplingParams.model_fields})
        except ValidationError as exc:
            raise _invalid(exc, "invalid sampling settings") from None
        self.check_logprobs(body)

    def check_logprobs(self, body: SamplingRequest) -> None:
        """400 for chat's ``top_logprobs`` > 0 without ``logprobs: true`` (OpenAI's rule), and for
        log-probabilities from a decoder without a tokenizer (no token texts to send)."""
        if getattr(body, "top_logprobs", None) and not getattr(body, "logprobs", None):
            raise APIError(400, "top_logprobs needs logprobs: true (top_logprobs is how many of the most likely "
                                "tokens to return with each token's log-probability)", param="top_logprobs")
        if body.requested_logprobs() is not None and self.token_texts is None:
            raise APIError(400, "logprobs: this server's decoder has no tokenizer, so it has no token texts to "
                                "return them with", param="logprobs", code="unsupported_parameter")

    def max_new_tokens(self, requested: int | None, default: int, prompt_len: int, param: str) -> int:
        max_context = self.decoder.target.max_context
        room = max_context - prompt_len
        if room < 1:  # the decoder refuses the prompt with its own message
            return requested or default
        if requested is None:
            return min(default, room)
        if requested > room:
            raise APIError(400, f"{param}={requested} does not fit: the model's context holds {max_context} tokens "
                                f"and the prompt has {prompt_len}, which leaves {room}; ask for at most {room}",
                           param=param)
        return requested

    async def submit(self, body: SamplingRequest, kind: type[_Reply]) -> list:
        """Check the prompt, then encode it and hand the request to the engine (a worker thread: both
        block); a stream per choice (``n``)."""
        encode = kind.encoder(body, self.decoder, self.check_length)
        requested, param = kind.max_tokens(body)
        text = body.prediction.text if body.prediction is not None else ""
        if text:
            self.check_length(text, "prediction")

        asked = body.requested_logprobs()  # passed only when asked for: any decoder takes the rest
        logprobs = {} if asked is None else {"logprobs": asked, "logprobs_mode": self.logprobs_mode}
        choices = {} if body.n in (None, 1) else {"n": body.n}  # passed only when asked for, as logprobs

        def _submit():
            ids = encode()
            limit = self.max_new_tokens(requested, kind.default_max_tokens, len(ids), param)
            streams = self.decoder.stream_ids(ids, max_new_tokens=limit, prediction=self.prediction(text),
                                              **body.sampling(), **logprobs, **choices)
            return streams if choices else [streams]

        try:
            return await self.blocking(_submit)
        except ConfigError as exc:  # the decoder's own checks: the 400 names the parameter at fault
            raise APIError(400, str(exc), param=_config_param(exc, body, kind.prompt_param, param)) from None

    def prediction(self, text: str) -> list[int] | None:
        """A request's predicted output as token ids (None: none, or empty); the decoder checks
        them (too long for the context: its ConfigError, a 400)."""
        return self.decoder.tokenizer(text, add_special_tokens=False).input_ids if text else None

    async def blocking(self, func, *args):
        """``func(*args)`` in a worker thread (at most :data:`BLOCKING_THREADS` at once)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(BLOCKING_THREADS)
        return await anyio.to_thread.run_sync(func, *args, limiter=self._limiter)

    async def bursts(self, stream, started: float) -> AsyncIterator:
        """The stream's bursts as the output loop reads them; the first with tokens is observed as
        the time to first token."""
        first = True
        async for chunk in self.outputs.watch(stream):
            if first and chunk.token_ids:
                self.metrics.first_token(time.monotonic() - started)
                first = False
            yield chunk

    def finished(self, started: float, result) -> None:
        reason = "abort" if result is None else FINISH_REASONS.get(result.finish_reason, "abort")
        self.metrics.record(result, time.monotonic() - started, reason)

    def abort(self, stream, started: float) -> None:
        """Free the sequence now (the request failed, or its client went away) and count it as aborted."""
        stream.close()
        self.metrics.record(stream.result, time.monotonic() - started, "abort")

    async def run_to_end(self, request: Request, stream, started: float):
        """Read the stream to its end; the client going away closes it (None is returned)."""
        done, error = False, None
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_cancel_on_disconnect, request, group.cancel_scope)
                try:
                    async for _ in self.bursts(stream, started):
                        pass
                    done = True
                except Exception as exc:  # raised below, outside the task group (no ExceptionGroup)
                    error = exc
                group.cancel_scope.cancel()
        finally:
            if not done:  # failed, or the client went away
                self.abort(stream, started)
        if error is not None:
            raise error
        if not done:
            return None
        self.finished(started, stream.result)
        return stream.result

    def event_stream(self, streams: list, started: float, reply: _Reply, include_usage: bool) -> _EventStreamResponse:
        """Server-sent events of the choices' ``streams`` as ``reply``'s chunks (each chunk one
        choice's, its ``index`` saying which); they end with ``data: [DONE]``, after an error event
        if a stream failed."""
        settled: set[int] = set()  # the choices that finished, failed or were abandoned

        def abandon() -> None:
            """The client went away (or stopped reading) before the end: free the sequences now."""
            for index, stream in enumerate(streams):
                if index not in settled:
                    settled.add(index)
                    self.abort(stream, started)

        async def events():
            try:
                for index in range(len(streams)):
                    for choice in reply.opening(index):
                        yield reply.event([choice])
                async for index, chunk in self._merged(streams, started):
                    if chunk is not None:
                        logprobs = reply.chunk_logprobs(chunk, index)  # those of the tokens its text completes
                        if chunk.text:
                            yield reply.event([self._indexed(reply.stream_choice(chunk.text, logprobs=logprobs), index)])
                        continue
                    result = streams[index].result  # choice ``index`` ended
                    settled.add(index)
                    self.finished(started, result)
                    last = reply.stream_choice(None, _finish_reason(result), logprobs=reply.chunk_logprobs(index=index))
                    yield reply.event([self._indexed(last, index)], spec_decode=SpecDecodeInfo.from_stats(result.stats))
                if include_usage:
                    results = [stream.result for stream in streams]
                    yield reply.event([], usage=_usage(streams, results),
                                      spec_decode=SpecDecodeInfo.from_stats(*(r.stats for r in results)))
            except Exception as exc:  # after the response started: one error event, then [DONE]
                abandon()
                yield _sse(self.error(exc).body())
            finally:  # cancelled while reading the stream
                abandon()
            yield "data: [DONE]\n\n"

        return _EventStreamResponse(events(), on_exit=abandon)

    async def _merged(self, streams: list, started: float) -> AsyncIterator:
        """``(index, chunk)`` of every choice's bursts, a burst of each live choice in turn (they
        decode in the same steps), and ``(index, None)`` when choice ``index`` ends."""
        readers = [self.bursts(stream, started) for stream in streams]
        live = list(range(len(streams)))
        while live:
            for index in list(live):
                chunk = await anext(readers[index], None)
                if chunk is None:
                    live.remove(index)
                yield index, chunk

    @staticmethod
    def _indexed(choice, index: int):
        choice.index = index
        return choice


def create_app(decoder, *, model_name: str | None = None, api_key: str | None = None,
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


def _invalid(exc, what: str = "invalid request", data: Any = None) -> APIError:
    """A 400 from pydantic's errors (``exc.errors()``), naming the first parameter at fault (an
    unknown one first: ``unknown parameter 'X'``). With ``data`` (the request's JSON), the name
    stops where the body does (pydantic adds a union member's type to the location)."""
    errors = [e for e in exc.errors() if e["loc"]]
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        param = ".".join(str(p) for p in unknown[0]["loc"])
        return APIError(400, f"unknown parameter {param!r}: specdraft's server does not take it; remove it "
                             "(docs/serving.md lists the parameters it takes)", param=param, code="unknown_parameter")
    param = _param_path(errors[0]["loc"], None if errors[0].get("type") == "missing" else data) if errors else None
    return APIError(400, f"{what}: {describe_validation_error(exc)}", param=param)


def _param_path(loc: tuple, data: Any) -> str:
    """``loc`` as a dotted parameter name, cut where ``data`` has no such member (None: not cut,
    e.g. for a missing field)."""
    if data is None:
        return ".".join(str(p) for p in loc)
    parts, node = [], data
    for key in loc:
        member = isinstance(node, dict) and key in node
        if member or isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            parts.append(str(key))
            node = node[key]
        else:
            break
    return ".".join(parts) or ".".join(str(p) for p in loc)


def _config_param(exc: ConfigError, body, prompt_param: str, max_tokens_param: str = "max_tokens") -> str | None:
    """The request parameter the decoder's ConfigError is about (its message starts with its name)."""
    message = str(exc).removeprefix("invalid sampling settings: ")
    word = re.match(r"[A-Za-z_]*", message).group()
    if word == "prompt":
        return prompt_param
    if word == "max_new_tokens":
        return max_tokens_param
    if word in type(body).model_fields:
        return word
    if message.startswith("stop strings"):
        return "stop"
    if "chat template" in message:
        return "messages"
    return None


def _too_large(limit: int, what: str) -> APIError:
    return APIError(413, f"the request body is too large ({what}); this server reads at most {limit} bytes: send a "
                         "shorter prompt, or start the server with a larger --max-request-bytes",
                    code="request_too_large")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``limit`` bytes: by its
    Content-Length before reading any of it, or while a chunked one arrives (never buffered whole)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, f"Content-Length {int(declared)}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, f"more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_json(request: Request, limit: int) -> dict:
    """The request's body as a JSON object; APIError: 415 for a content type other than
    ``application/json``, 413 for a body over ``limit`` bytes, 400 for an empty body, bad JSON,
    nesting deeper than ``MAX_JSON_DEPTH`` or a lone surrogate in a string."""
    media = request.headers.get("content-type")
    if media is None or media.split(";", 1)[0].strip().lower() != "application/json":
        got = f"got {media.split(';', 1)[0].strip()!r}" if media else "it has none"
        raise APIError(415, f"the request body must be JSON sent with the header `Content-Type: application/json` "
                            f"({got}); with curl, add -H 'Content-Type: application/json'",
                       code="unsupported_media_type")
    raw = await _read_body(request, limit)
    if not raw.strip():
        raise APIError(400, "the request body is empty; send the parameters as a JSON object")
    try:
        # strict UTF-8: json.loads(bytes) would let encoded surrogates (b"\xed\xa0\x80") through
        data = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} (at character {exc.pos})") from None
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: it is not UTF-8 text (byte {exc.start}); "
                            "send the JSON encoded as UTF-8") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", type(None): "null"}.get(type(data), "a number or boolean")
        raise APIError(400, f"the request body must be a JSON object of parameters, got {kind}")
    _check_json(raw, data)
    return data


def _too_deep() -> APIError:
    return APIError(400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
                         "send the parameters as documented (a request nests a few levels)")


#: a JSON escape of a UTF-16 surrogate (\ud800-\udfff): only such escapes can give a string one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_json(raw: bytes, data: Any) -> None:
    """400 for nesting deeper than ``MAX_JSON_DEPTH``, and for a string or a key that holds a lone
    surrogate (JSON's ``"\\ud800"`` unpaired: no tokenizer takes it); the 400 names where. The
    walk runs only when ``raw`` could hold either (it has that many brackets, or such an escape)."""
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if not (deep or surrogates):
        return
    stack: list[tuple[tuple, Any, int]] = [((), data, 1)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, str):
            if surrogates:
                _check_text(value, ".".join(map(str, path)))
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        items = list(value.items() if isinstance(value, dict) else enumerate(value))
        for key, item in reversed(items):  # the first member is checked first
            if isinstance(key, str) and surrogates:
                _check_text(key, ".".join(map(str, (*path, key))), "the parameter name ")
            stack.append(((*path, key), item, depth + 1))


def _check_text(text: str, where: str, what: str = "") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = where.encode("utf-8", "backslashreplace").decode("utf-8")
        raise APIError(400, f"{what}{where or 'the body'} is not valid text: it holds a lone surrogate "
                            f"({text[exc.start:exc.end]!r}) at character {exc.start}; send valid Unicode (a "
                            "\\ud800-\\udfff escape must be half of a pair)", param=where or None) from None


def _validate(data: dict, model: type[OpenAIBaseModel]):
    """``data`` as ``model``; APIError (400) naming the parameter at fault."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, data=data) from None


async def _parse(request: Request, model: type[OpenAIBaseModel], limit: int = DEFAULT_MAX_REQUEST_BYTES):
    """The request's JSON body (see :func:`_read_json`) as ``model``."""
    return _validate(await _read_json(request, limit), model)


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` (the decoder refuses the names that are not template variables)."""
    return dict(kwargs or {})


def _completion_prompt(prompt) -> str | list[int]:
    """A completion request's prompt as text or token ids; APIError for anything else."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise APIError(400, "prompt is empty; give some text to continue", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    got = ("a list of several prompts" if isinstance(prompt, list) and len(prompt) > 1
           else "an empty list" if prompt == [] else "no prompt" if prompt is None else type(prompt).__name__)
    raise APIError(400, f"prompt must be a string, a list of one string or a list of token ids (got {got}); "
                        "send one prompt per request", param="prompt")


def _chat_messages(body) -> list[dict[str, str]]:
    """The messages as ``[{"role", "content"}]`` (and ``name`` where given) for the chat template;
    text content parts are joined with newlines. APIError (400, naming the field) for a role other
    than system, developer, user and assistant (tool and function: no tool calling), for null
    content outside an assistant's message, for parts other than text (images, audio), and for
    tool calls or a refusal echoed back in an assistant's message."""
    messages = []
    for i, message in enumerate(body.messages):
        at, role, content = f"messages.{i}", message.role, message.content
        if role in ("tool", "function"):
            raise APIError(400, f"{at}.role: {role!r} messages are not supported: specdraft's server has no tool "
                                f"calling; send {', '.join(CHAT_ROLES)} messages", param=f"{at}.role",
                           code="unsupported_parameter")
        if role not in CHAT_ROLES:
            raise APIError(400, f"{at}.role: unknown role {role!r}; use one of {', '.join(CHAT_ROLES)}",
                           param=f"{at}.role")
        for name in ("tool_calls", "function_call", "tool_call_id", "refusal"):
            if getattr(message, name) not in (None, []):
                raise APIError(400, f"{at}.{name}: not supported by specdraft's server (it has no tool calling); "
                                    "send the message's text as its content", param=f"{at}.{name}",
                               code="unsupported_parameter")
        if content is None:
            if role != "assistant":
                raise APIError(400, f"{at}.content: a {role} message needs content (a string or a list of text "
                                    "parts); only an assistant's may be null", param=f"{at}.content")
            content = ""
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"{at}.content: only text parts are supported "
                                        f"(got type {part.get('type')!r})", param=f"{at}.content")
                extra = sorted(set(part) - {"type", "text"})
                if extra:
                    param = f"{at}.content.{j}.{extra[0]}"
                    raise APIError(400, f"unknown parameter {param!r}: a text part is {{\"type\": \"text\", "
                                        "\"text\": ...}; remove it", param=param, code="unknown_parameter")
                texts.append(part["text"])
            content = "\n".join(texts)
        entry = {"role": "system" if role == "developer" else role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    return messages
