"""Request and response bodies of the OpenAI-compatible server, in OpenAI's shapes.

Modelled on vLLM's ``vllm/entrypoints/openai/protocol.py``: requests accept unknown fields
(OpenAI clients send some, e.g. ``user`` or ``store``) and the server ignores them; the
OpenAI parameters specdraft cannot honour (``logprobs``, ``echo``, ``tools``, ...) are declared
so that :meth:`unsupported` can name them in a 400 when a request sets them. Two additions
to OpenAI's responses: ``spec_decode`` (what speculation did for the request) and
``max_model_len`` on the model card (as vLLM).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: chat requests without max_tokens / max_completion_tokens generate at most this many tokens
#: (less when the context has less room left after the prompt)
CHAT_DEFAULT_MAX_TOKENS = 1024
#: completion requests without max_tokens generate at most this many tokens (OpenAI's default)
COMPLETION_DEFAULT_MAX_TOKENS = 16


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    # unknown fields are kept (not rejected) so that clients sending newer OpenAI fields work
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        """The fields of the request that are not OpenAI parameters specdraft knows."""
        return sorted(self.model_extra or {})


# -- errors ---------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- models ---------------------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specdraft"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# -- shared pieces ----------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class CompletionTokensDetails(OpenAIBaseModel):
    """OpenAI's Predicted Outputs usage: predicted tokens the target verified and kept, and verified and refused."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: CompletionTokensDetails | None = None  # requests with a prediction


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class PredictionParam(OpenAIBaseModel):
    """OpenAI's ``prediction``: ``{"type": "content", "content": "..."}`` (or a list of text parts)."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class SpecDecodeInfo(OpenAIBaseModel):
    """What speculation did for one request (from its :class:`~specdraft.GenerationStats`)."""

    drafted_tokens: int = 0  # tokens the drafter proposed and the target verified
    accepted_tokens: int = 0  # of those, the ones the target kept
    acceptance_rate: float = 0.0  # accepted_tokens / drafted_tokens
    tokens_per_target_pass: float = 0.0  # completion tokens / target_passes (bonus tokens included)
    drafts: int = 0  # rounds that drafted at least one token
    target_passes: int = 0  # verify passes of the target (the prompt's prefill not counted)

    @classmethod
    def from_stats(cls, stats) -> "SpecDecodeInfo":
        return cls(drafted_tokens=stats.drafted_tokens, accepted_tokens=stats.accepted_tokens,
                   acceptance_rate=stats.acceptance_rate, tokens_per_target_pass=stats.tokens_per_pass,
                   drafts=stats.drafts, target_passes=stats.target_passes)


class SamplingRequest(OpenAIBaseModel):
    """The parameters completions and chat completions share."""

    model: str | None = None  # None: the served model
    # sampling: None = the default (OpenAI's temperature 1, the others off); the decoder checks ranges
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # specdraft/vLLM extension; 0 or -1 = off
    min_p: float | None = None  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1  # only 1
    #: Predicted Outputs: text the answer is expected to repeat much of; drafted from, never changes the output
    prediction: PredictionParam | None = None
    # OpenAI parameters that are declared only to be refused when set (see ``unsupported``)
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None

    def sampling(self) -> dict[str, Any]:
        """The decoder's keyword arguments for the sampling settings, defaults filled in."""
        top_k = self.top_k if self.top_k is not None else 0
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if top_k == -1 else top_k,
            "min_p": self.min_p or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "seed": self.seed,
            "stop": self.stop,
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> str | None:
        """The first parameter this request sets that specdraft does not support, else None."""
        if self.n not in (None, 1):
            return "n"
        if self.logit_bias:
            return "logit_bias"
        if self.logprobs not in (None, False):
            return "logprobs"
        return None


# -- /v1/completions --------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    # a string, a list of exactly one string, or a list of token ids (checked by the server,
    # which says which of these it got wrong)
    prompt: Any = None
    max_tokens: int | None = Field(None, ge=1)  # None: COMPLETION_DEFAULT_MAX_TOKENS
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.best_of not in (None, 1):
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()


class CompletionResponseChoice(OpenAIBaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    spec_decode: SpecDecodeInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    spec_decode: SpecDecodeInfo | None = None


# -- /v1/chat/completions -------------------------------------------------------------------


class ChatMessageParam(OpenAIBaseModel):
    role: str
    # a string, or a list of content parts of which only {"type": "text", "text": ...} is supported
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none"):
            return "tool_choice"
        if self.functions:
            return "functions"
        if self.function_call not in (None, "none"):
            return "function_call"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        if self.top_logprobs:
            return "top_logprobs"
        return super().unsupported()


class ChatMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
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


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
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
