"""The path both generating routes share (``/v1/completions`` and ``/v1/chat/completions``): a
request checked, encoded and submitted to the engine, then its answer read to the end or streamed
as server-sent events, its streams read by the output loop (:mod:`.outputs`). What differs by
route (how the request is read, how the answer is shaped) is a :class:`Reply`:
:mod:`.completions`, :mod:`.chat`."""

from __future__ import annotations

import json
import time
from typing import AsyncIterator

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..errors import ConfigError
from ..settings import GenerationSettings
from .bodies import parse
from .errors import APIError, config_param
from .logprobs import StreamedLogprobs, TokenTexts
from .protocol import (CompletionTokensDetails, OpenAIBaseModel, PromptTokensDetails, SamplingRequest, SpecDecodeInfo,
                       UsageInfo, now, random_id)

#: the engine's finish reasons as OpenAI's
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


class EventStreamResponse(StreamingResponse):
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


async def cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` once the client goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def openai_finish_reason(result) -> str:
    """The engine's finish reason as OpenAI's."""
    return FINISH_REASONS.get(result.finish_reason, result.finish_reason)


def request_usage(streams: list, results: list) -> UsageInfo:
    """The usage of a request's choices (``streams``, their ``results``): the prompt once, the
    completions summed."""
    stream, result = streams[0], results[0]
    stats = result.stats if result is not None else stream.seq.stats
    prompt = result.stats.prompt_tokens if result is not None else stream.prompt_tokens
    completion = sum(len(r.token_ids) for r in results if r is not None)
    details = None
    if stream.seq.prediction is not None:  # OpenAI's Predicted Outputs usage
        details = CompletionTokensDetails(accepted_prediction_tokens=stats.accepted_prediction_tokens,
                                          rejected_prediction_tokens=stats.rejected_prediction_tokens)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens),
                     completion_tokens_details=details)


class Reply:
    """What a generating route adds to the path both share (:meth:`GeneratingRoutes.generate`): how its
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

    def prepare(self, body, decoder) -> None:
        """Read what shapes the answer from the request before it is submitted (ConfigError: a 400)."""

    def opening(self, index: int = 0) -> list:
        """Choice ``index``'s streamed choices sent before its first token, one chunk each."""
        return []

    def chunk_choices(self, chunk, index: int) -> list:
        """The streamed choices (one chunk each) of a burst of choice ``index``."""
        logprobs = self.chunk_logprobs(chunk, index)  # those of the tokens its text completes
        return [_indexed(self.stream_choice(chunk.text, logprobs=logprobs), index)] if chunk.text else []

    def closing_choices(self, index: int, result) -> list:
        """The streamed choices that end choice ``index`` (the last with its finish reason)."""
        last = self.stream_choice(None, openai_finish_reason(result), logprobs=self.chunk_logprobs(index=index))
        return [_indexed(last, index)]

    def whole_choice(self, index: int, result):
        """Choice ``index`` of the whole answer."""
        return self.choice(result.text or "", openai_finish_reason(result))

    def whole(self, streams: list, results: list) -> dict:
        """The whole answer: a choice per result (``index`` in order)."""
        choices = []
        for index, result in enumerate(results):
            choice = self.whole_choice(index, result)
            choice.index, choice.logprobs = index, self.whole_logprobs(result)
            choices.append(choice)
        return self.response(id=self.id, created=self.created, model=self.model, choices=choices,
                             usage=request_usage(streams, results),
                             spec_decode=SpecDecodeInfo.from_stats(*(r.stats for r in results))).model_dump()

    def event(self, choices: list, usage: UsageInfo | None = None, spec_decode: SpecDecodeInfo | None = None) -> str:
        """A stream chunk as OpenAI sends it: null fields left out, but every choice's finish_reason kept."""
        data = self.stream_response(id=self.id, created=self.created, model=self.model, choices=choices,
                                    usage=usage, spec_decode=spec_decode).model_dump(exclude_none=True)
        for choice in data.get("choices", []):
            choice.setdefault("finish_reason", None)
        return sse(data)


class GeneratingRoutes:
    """The generating path, a mixin of the app's server (:mod:`.app`), which supplies ``decoder``,
    ``served``, ``metrics``, ``max_request_bytes``, ``logprobs_mode``, ``token_texts``,
    ``outputs``, ``check_served``, ``check_length``, ``blocking`` and ``error``."""


    async def generate(self, request: Request, kind: type[Reply]):
        """Both generating routes: the request submitted to the engine, then its answer streamed
        or read to the end; any failure before the answer starts is answered as an error."""
        try:
            body = await parse(request, kind.request, self.max_request_bytes)
            started = time.monotonic()
            settings = self.check_model(body, kind)
            reply = kind(self.served, None if body.requested_logprobs() is None else self.token_texts)
            try:
                reply.prepare(body, self.decoder)
            except ConfigError as exc:
                raise APIError(400, str(exc), param=config_param(exc, kind.prompt_param)) from None
            streams = await self.submit(body, kind, settings)
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

    def check_model(self, body: SamplingRequest, kind: type[Reply]) -> GenerationSettings:
        """The served model, no parameter specdraft cannot honour, and the request's settings (checked
        here, before the prompt is tokenized, so that the 400 names the parameter)."""
        self.check_served(body)
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, f"{bad}: not supported by specdraft's server"
                                + (" (only n=1)" if bad == "n" else ""), param=bad, code="unsupported_parameter")
        self.check_logprobs(body)
        requested, param = kind.max_tokens(body)
        try:
            return body.settings(requested or kind.default_max_tokens, self.logprobs_mode)
        except ConfigError as exc:
            raise APIError(400, str(exc), param=config_param(exc, kind.prompt_param, param)) from None

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

    async def submit(self, body: SamplingRequest, kind: type[Reply], settings: GenerationSettings) -> list:
        """Check the prompt, then encode it and hand the request to the engine (a worker thread: both
        block); a stream per choice (``n``)."""
        cut = settings.truncate_prompt_tokens  # a prompt cut to its last tokens may be longer than the context
        encode = kind.encoder(body, self.decoder, self.check_length if cut is None else lambda text, what: None)
        requested, param = kind.max_tokens(body)
        if isinstance(settings.prediction, str):
            self.check_length(settings.prediction, "prediction")

        def _submit():
            ids = encode()
            limit = self.max_new_tokens(requested, kind.default_max_tokens, min(len(ids), cut or len(ids)), param)
            streams = self.decoder.stream_ids(ids, settings if limit == settings.max_new_tokens
                                              else settings.replace(max_new_tokens=limit))
            return streams if settings.n > 1 else [streams]

        try:
            return await self.blocking(_submit)
        except ConfigError as exc:  # the decoder's own checks: the 400 names the parameter at fault
            raise APIError(400, str(exc), param=config_param(exc, kind.prompt_param, param)) from None

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
        """Read the stream to its end; the client going away closes it (None is returned). Its
        bursts carry no text: only the result's is replied."""
        stream.texts = False
        done, error = False, None
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(cancel_on_disconnect, request, group.cancel_scope)
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

    def event_stream(self, streams: list, started: float, reply: Reply, include_usage: bool) -> EventStreamResponse:
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
                        for choice in reply.chunk_choices(chunk, index):
                            yield reply.event([choice])
                        continue
                    result = streams[index].result  # choice ``index`` ended
                    settled.add(index)
                    self.finished(started, result)
                    *choices, last = reply.closing_choices(index, result)
                    for choice in choices:
                        yield reply.event([choice])
                    yield reply.event([last], spec_decode=SpecDecodeInfo.from_stats(result.stats))
                if include_usage:
                    results = [stream.result for stream in streams]
                    yield reply.event([], usage=request_usage(streams, results),
                                      spec_decode=SpecDecodeInfo.from_stats(*(r.stats for r in results)))
            except Exception as exc:  # after the response started: one error event, then [DONE]
                abandon()
                yield sse(self.error(exc).body())
            finally:  # cancelled while reading the stream
                abandon()
            yield "data: [DONE]\n\n"

        return EventStreamResponse(events(), on_exit=abandon)

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


def _indexed(choice, index: int):
    choice.index = index
    return choice
