"""The OpenAI-compatible HTTP API over a :class:`~specdraft.SpeculativeDecoder`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with server-sent-event streaming), ``GET /health`` and ``GET /metrics`` (Prometheus).

The decoder's engine decodes in its own thread; this app only submits requests
(``decoder.stream_ids``) and reads their streams, each blocking read in a worker thread, so
the event loop never waits on the model. Every error is OpenAI's JSON
``{"error": {"message", "type", "param", "code"}}`` with a one-line message: 400 bad
parameters, 401 a missing or wrong API key, 404 an unknown model or path, 429 a full queue,
500 a failed drafter or anything unexpected (logged here with its traceback).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import ConfigError, DrafterError, QueueFull, SpecdraftError, describe_validation_error
from .metrics import ServerMetrics
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
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    OpenAIBaseModel,
    SamplingRequest,
    SpecDecodeInfo,
    UsageInfo,
    now,
    random_id,
)

logger = logging.getLogger("specdraft.server")

#: the engine's finish reasons as OpenAI's
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
#: worker threads that may wait on streams at once (each running or waiting request holds one
#: while it waits for its next burst); apart from the default pool, which encodes prompts
STREAM_THREADS = 512


class APIError(Exception):
    """An error answered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, _one_line(message), type, param, code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "error"


def as_api_error(exc: BaseException) -> APIError:
    """The status and message a failure is answered with; logs the unexpected ones."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full")
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
    """401 for ``/v1/...`` requests without ``Authorization: Bearer <key>`` (``/health`` and
    ``/metrics`` stay open, as in vLLM). Plain ASGI, so it never wraps a stream's ``receive``."""

    def __init__(self, app, api_key: str, metrics: ServerMetrics) -> None:
        self.app, self.key, self.metrics = app, api_key.encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
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


_END = object()


def _next_chunk(iterator):
    try:
        return next(iterator)
    except StopIteration:
        return _END


def create_app(decoder, *, model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``decoder`` as ``model_name`` (default: the target's name).

    With ``api_key`` every ``/v1`` request must send ``Authorization: Bearer <api_key>``.
    """
    served = model_name or decoder.target.name or "specdraft"
    metrics = ServerMetrics(decoder, served)
    app = FastAPI(title="specdraft", version=__version__,
                  description="OpenAI-compatible server of exact speculative decoding")
    app.state.decoder, app.state.metrics, app.state.model_name = decoder, metrics, served
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, metrics=metrics)
    limiter: list[anyio.CapacityLimiter] = []  # made on first use, inside the event loop

    def error_response(exc: BaseException) -> JSONResponse:
        error = as_api_error(exc)
        metrics.error(error.status)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError):
        return error_response(_invalid(_BodyErrors(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{exc.detail}: {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        return error_response(APIError(exc.status_code, str(message), code=code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(exc)

    # -- helpers --------------------------------------------------------------------------

    def check_model(body: SamplingRequest) -> None:
        if body.model is not None and body.model != served:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {served!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, f"{bad}: not supported by specdraft's server"
                                + (" (only n=1)" if bad == "n" else ""), param=bad, code="unsupported_parameter")
        ignored = body.ignored_fields()
        if ignored:
            logger.debug("ignoring request fields specdraft does not know: %s", ", ".join(ignored))

    def max_new_tokens(requested: int | None, default: int, prompt_len: int, param: str) -> int:
        room = decoder.target.max_context - prompt_len
        if room < 1:  # the decoder refuses the prompt with its own message
            return requested or default
        if requested is None:
            return min(default, room)
        if requested > room:
            raise APIError(400, f"{param}={requested} does not fit: the model's context holds "
                                f"{decoder.target.max_context} tokens and the prompt has {prompt_len}, which leaves "
                                f"{room}; ask for at most {room}", param=param)
        return requested

    async def submit(body: SamplingRequest, encode, requested: int | None, default: int, param: str):
        """Encode the prompt and hand the request to the engine (a worker thread: both block)."""

        def _submit():
            ids = encode()
            limit = max_new_tokens(requested, default, len(ids), param)
            return decoder.stream_ids(ids, max_new_tokens=limit, **body.sampling())

        return await run_in_threadpool(_submit)

    async def chunks(stream) -> AsyncIterator:
        """The stream's bursts, each read in a worker thread that a cancelled request abandons."""
        if not limiter:
            limiter.append(anyio.CapacityLimiter(STREAM_THREADS))
        iterator = iter(stream)
        while True:
            chunk = await anyio.to_thread.run_sync(_next_chunk, iterator, abandon_on_cancel=True,
                                                   limiter=limiter[0])
            if chunk is _END:
                return
            yield chunk

    def finished(started: float, result, aborted: bool = False) -> None:
        reason = "abort" if aborted or result is None else FINISH_REASONS.get(result.finish_reason, "abort")
        metrics.record(result, time.monotonic() - started, reason)

    def usage_of(stream, result) -> UsageInfo:
        prompt = result.stats.prompt_tokens if result is not None else stream.prompt_tokens
        completion = len(result.token_ids) if result is not None else 0
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def run_to_end(request: Request, stream, started: float):
        """Read the stream to its end; the client going away closes it (None is returned)."""
        done, error = False, None
        try:
            async with anyio.create_task_group() as group:

                async def watch_disconnect() -> None:
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(watch_disconnect)
                try:
                    first = True
                    async for chunk in chunks(stream):
                        if first and chunk.token_ids:
                            metrics.first_token(time.monotonic() - started)
                            first = False
                    done = True
                except Exception as exc:  # raised below, outside the task group (no ExceptionGroup)
                    error = exc
                group.cancel_scope.cancel()
        finally:
            if not done:  # failed, or the client went away: free the sequence now
                stream.close()
                finished(started, stream.result, aborted=True)
        if error is not None:
            raise error
        if not done:
            return None
        finished(started, stream.result)
        return stream.result

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def chunk_dict(model) -> dict:
        """A stream chunk as OpenAI sends it: null fields left out, but every choice's finish_reason kept."""
        data = model.model_dump(exclude_none=True)
        for choice in data.get("choices", []):
            choice.setdefault("finish_reason", None)
        return data

    def event_stream(stream, started: float, make_chunk, opening: list[dict], include_usage: bool):
        """Server-sent events of ``stream``: ``make_chunk(text=..., finish_reason=..., ...)`` builds a
        chunk; the stream ends with ``data: [DONE]``, after an error event if it failed."""
        settled = []  # non-empty once the request finished, failed or was abandoned

        def abandon() -> None:
            """The client went away (or stopped reading) before the end: free the sequence now."""
            if not settled:
                settled.append(True)
                stream.close()
                finished(started, stream.result, aborted=True)

        async def events():
            try:
                for payload in opening:
                    yield sse(payload)
                first = True
                async for chunk in chunks(stream):
                    if first and chunk.token_ids:
                        metrics.first_token(time.monotonic() - started)
                        first = False
                    if chunk.text:
                        yield sse(chunk_dict(make_chunk(text=chunk.text)))
                result = stream.result
                settled.append(True)
                finished(started, result)
                info = SpecDecodeInfo.from_stats(result.stats)
                reason = FINISH_REASONS.get(result.finish_reason, result.finish_reason)
                yield sse(chunk_dict(make_chunk(text=None, finish_reason=reason, spec_decode=info)))
                if include_usage:
                    yield sse(chunk_dict(make_chunk(text=None, usage=usage_of(stream, result), spec_decode=info,
                                                    no_choices=True)))
            except Exception as exc:  # after the response started: one error event, then [DONE]
                abandon()
                yield sse(error_body(exc))
            finally:  # cancelled while reading the stream
                abandon()
            yield "data: [DONE]\n\n"

        return _EventStreamResponse(events(), on_exit=abandon)

    def error_body(exc: BaseException) -> dict:
        error = as_api_error(exc)
        metrics.error(error.status)
        return error.body()

    # -- endpoints ------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=served, root=decoder.target.name or served, max_model_len=decoder.target.max_context)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            return await complete(await _parse(request, CompletionRequest), request)
        except Exception as exc:
            return error_response(exc)

    async def complete(body: CompletionRequest, request: Request):
        started = time.monotonic()
        check_model(body)
        prompt = _completion_prompt(body.prompt)
        encode = (lambda: list(prompt)) if isinstance(prompt, list) else (lambda: decoder.encode(prompt, raw=True))
        stream = await submit(body, encode, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
        rid, created = random_id("cmpl"), now()
        if body.stream:
            def make_chunk(text, finish_reason=None, usage=None, spec_decode=None, no_choices=False):
                choices = [] if no_choices else [CompletionResponseStreamChoice(text=text or "",
                                                                                finish_reason=finish_reason)]
                return CompletionStreamResponse(id=rid, created=created, model=served, choices=choices,
                                                usage=usage, spec_decode=spec_decode)

            return event_stream(stream, started, make_chunk, [], body.include_usage)
        result = await run_to_end(request, stream, started)
        if result is None:
            return Response(status_code=204)  # nobody is listening
        choice = CompletionResponseChoice(text=result.text or "", finish_reason=FINISH_REASONS.get(
            result.finish_reason, result.finish_reason))
        return CompletionResponse(id=rid, created=created, model=served, choices=[choice],
                                  usage=usage_of(stream, result),
                                  spec_decode=SpecDecodeInfo.from_stats(result.stats)).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            return await chat(await _parse(request, ChatCompletionRequest), request)
        except Exception as exc:
            return error_response(exc)

    async def chat(body: ChatCompletionRequest, request: Request):
        started = time.monotonic()
        check_model(body)
        messages = _chat_messages(body)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        stream = await submit(body, lambda: decoder.encode_chat(messages), body.requested_max_tokens,
                              CHAT_DEFAULT_MAX_TOKENS, param)
        rid, created = random_id("chatcmpl"), now()
        if body.stream:
            def make_chunk(text, finish_reason=None, usage=None, spec_decode=None, no_choices=False, role=None):
                delta = DeltaMessage(role=role, content=text)
                choices = [] if no_choices else [ChatCompletionResponseStreamChoice(delta=delta,
                                                                                    finish_reason=finish_reason)]
                return ChatCompletionStreamResponse(id=rid, created=created, model=served, choices=choices,
                                                    usage=usage, spec_decode=spec_decode)

            opening = [chunk_dict(make_chunk(text="", role="assistant"))]
            return event_stream(stream, started, make_chunk, opening, body.include_usage)
        result = await run_to_end(request, stream, started)
        if result is None:
            return Response(status_code=204)
        choice = ChatCompletionResponseChoice(message=ChatMessage(content=result.text or ""),
                                              finish_reason=FINISH_REASONS.get(result.finish_reason,
                                                                               result.finish_reason))
        return ChatCompletionResponse(id=rid, created=created, model=served, choices=[choice],
                                      usage=usage_of(stream, result),
                                      spec_decode=SpecDecodeInfo.from_stats(result.stats)).model_dump()

    return app


def _invalid(exc) -> APIError:
    """A 400 from pydantic's errors (``exc.errors()``), naming the first parameter at fault."""
    locs = [e["loc"] for e in exc.errors() if e["loc"]]
    param = ".".join(str(p) for p in locs[0]) if locs else None
    return APIError(400, f"invalid request: {describe_validation_error(exc)}", param=param)


async def _parse(request: Request, model: type[OpenAIBaseModel]):
    """The request's JSON body as ``model``, whatever its content type (curl's ``-d`` sends
    form-encoded); APIError (400) for an empty body, bad JSON, or invalid parameters."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request body is empty; send the parameters as a JSON object")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} (at character {exc.pos})") from None
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid JSON: it is not UTF-8 text") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", type(None): "null"}.get(type(data), "a number or boolean")
        raise APIError(400, f"the request body must be a JSON object of parameters, got {kind}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


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


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as ``[{"role", "content"}]`` for the chat template; text content parts are
    joined with newlines, other parts (images, audio) are refused."""
    messages = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages.{i}.content: only text parts are supported "
                                        f"(got type {part.get('type')!r})", param=f"messages.{i}.content")
                texts.append(part["text"])
            content = "\n".join(texts)
        role = "system" if message.role == "developer" else message.role
        messages.append({"role": role, "content": content or ""})
    return messages
