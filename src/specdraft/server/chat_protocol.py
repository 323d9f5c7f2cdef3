"""``/v1/chat/completions``'s request and response bodies, in OpenAI's shapes (the rules of
:mod:`.protocol`, whose shared models they build on)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr

from ..types import MAX_LOGPROBS
from .protocol import ChatMessageParam, OpenAIBaseModel, SamplingRequest, SpecDecodeInfo, UsageInfo, now, random_id


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    #: the log-probability of each output token, and (``top_logprobs``) of the N most likely there
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    #: the functions the model may call, whether and which it must (see :mod:`specdraft.tools`)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools: refused, naming tools
    function_call: Any = None
    reasoning_effort: str | None = None  # refused when set: the output would not follow it
    verbosity: str | None = None  # refused when set, as reasoning_effort
    audio: Any = None  # refused when set: text only
    web_search_options: Any = None  # refused when set
    #: more variables for the chat template (vLLM's extension; e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # accepted without effect: specdraft stores nothing, has one service tier, keys its prefix cache
    # by the tokens themselves, and answers with text
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    modalities: list[Literal["text"]] | None = None  # only ["text"]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    _tool_request: tuple | None = PrivateAttr(default=None)  # (ToolRequest or None,) once read

    def tool_request(self):
        """The request's :class:`~specdraft.tools.ToolRequest` (None: no tools), read once;
        ConfigError naming the field."""
        from ..tools import read_tools

        if self._tool_request is None:
            self._tool_request = (read_tools(self.tools, self.tool_choice, self.parallel_tool_calls),)
        return self._tool_request[0]

    def settings(self, max_new_tokens: int, logprobs_mode: str = "processed"):
        settings = super().settings(max_new_tokens, logprobs_mode)
        tools = self.tool_request()
        return settings if tools is None else tools.apply(settings)

    def unsupported(self) -> str | None:
        if self.functions:
            return "functions"
        if self.function_call not in (None, "none"):
            return "function_call"
        for name in ("reasoning_effort", "verbosity", "audio", "web_search_options"):
            if getattr(self, name) is not None:
                return name
        return super().unsupported()

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TopLogprob(OpenAIBaseModel):
    """One of the most likely tokens at an output position: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(TopLogprob):
    """An output token's log-probability, and the ``top_logprobs`` most likely tokens at its position."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    """OpenAI's chat ``choices[].logprobs``: one entry per output token."""

    content: list[ChatCompletionTokenLogprob] | None = None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    spec_decode: SpecDecodeInfo


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A piece of call ``index``: its first (``id``, ``type``, ``function.name``) or more of ``function.arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    spec_decode: SpecDecodeInfo | None = None
