"""Request and response bodies of the OpenAI-compatible server, in OpenAI's shapes.

Modelled on vLLM's ``vllm/entrypoints/openai/protocol.py``, but nothing a request sends is
silently dropped: request bodies (:class:`RequestModel`) refuse unknown fields (the server
answers 400 ``unknown parameter``) and check types strictly (``max_tokens: true`` or ``stream:
"yes"`` is a 400, not 1 or true; a float field takes an integer). The OpenAI fields that cannot
change the output (``user``, ``store``, ``metadata``, ...) are declared and accepted without
effect; the OpenAI parameters specdraft cannot honour (``echo``, ``functions``, ...)
are declared so that :meth:`unsupported` can name them in a 400 when a request sets them. Two
additions to OpenAI's responses: ``spec_decode`` (what speculation did for the request) and
``max_model_len`` on the model card (as vLLM).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..settings import GenerationSettings
from ..types import MAX_CHOICES, MAX_LOGPROBS

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
    # responses: built by the server itself
    model_config = ConfigDict(extra="allow")


class RequestModel(OpenAIBaseModel):
    """A request body (or a part of one): unknown fields are refused (the server's 400 names the
    first as ``unknown parameter``) and types are strict (no ``true`` for 1, no ``"yes"`` for
    true, no ``"0.5"`` for 0.5; an integer is still a valid float)."""

    model_config = ConfigDict(extra="forbid", strict=True)


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


class StreamOptions(RequestModel):
    include_usage: bool | None = False


class CompletionTokensDetails(OpenAIBaseModel):
    """OpenAI's Predicted Outputs usage: predicted tokens the target verified and kept, and verified and refused."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache held (the first choice's, as vLLM)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # requests with a prediction


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class PredictionParam(RequestModel):
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
    def from_stats(cls, stats, *more) -> "SpecDecodeInfo":
        """The figures of one request's stats, or of several (a request's ``n`` choices) summed."""
        every = (stats, *more)
        drafted, accepted = sum(s.drafted_tokens for s in every), sum(s.accepted_tokens for s in every)
        passes, tokens = sum(s.target_passes for s in every), sum(s.new_tokens for s in every)
        return cls(drafted_tokens=drafted, accepted_tokens=accepted,
                   acceptance_rate=accepted / drafted if drafted else 0.0,
                   tokens_per_target_pass=tokens / passes if passes else 0.0,
                   drafts=sum(s.drafts for s in every), target_passes=passes)


class SamplingRequest(RequestModel):
    """The parameters completions and chat completions share."""

    model: str | None = None  # None: the served model
    # accepted without effect: end-user ids for OpenAI's abuse monitoring
    user: str | None = None
    safety_identifier: str | None = None
    # sampling: None = the default (OpenAI's temperature 1, the others off); the decoder checks ranges
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # specdraft/vLLM extension; 0 or -1 = off
    min_p: float | None = None  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: str | list[str] | None = None
    # vLLM's extensions (the decoder checks them): keep going past EOS; no EOS, stop token or stop
    # string before this many tokens; token ids that end the answer like EOS
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    #: vLLM's: keep only the prompt's last this many tokens (after the chat template)
    truncate_prompt_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    #: choices: the prompt prefilled once, each choice with its own random numbers
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    #: Predicted Outputs: text the answer is expected to repeat much of; drafted from, never changes the output
    prediction: PredictionParam | None = None
    #: structured output (checked by :meth:`grammar`): OpenAI's response_format ({"type": "json_object"},
    #: {"type": "json_schema", "json_schema": {...}}), vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI parameters that are declared only to be refused when set (see ``unsupported``)
    logit_bias: dict[str, float] | None = None

    def settings(self, max_new_tokens: int, logprobs_mode: str = "processed") -> GenerationSettings:
        """The request's :class:`~specdraft.GenerationSettings` (OpenAI's defaults where unset; at
        most ``max_new_tokens``): the one place a body becomes settings. ConfigError (its ``param``
        a setting's name) for a value out of range."""
        top_k = self.top_k if self.top_k is not None else 0
        text = self.prediction.text if self.prediction is not None else ""
        return GenerationSettings(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if top_k == -1 else top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, stop=self.stop, ignore_eos=bool(self.ignore_eos),
            min_tokens=0 if self.min_tokens is None else self.min_tokens, stop_token_ids=self.stop_token_ids,
            n=1 if self.n is None else self.n, logprobs=self.requested_logprobs(), logprobs_mode=logprobs_mode,
            response_format=self.grammar(), prediction=text or None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            # JSON's keys are strings: token ids as ints, anything else left for the settings to name
            logit_bias={int(k) if k.strip().isdigit() else k: v for k, v in self.logit_bias.items()}
            if self.logit_bias else None,
        )

    def grammar(self):
        """The grammar (a :class:`~specdraft.grammar.GrammarSpec`) the request's structured
        output fields ask for, None for none; ConfigError naming the field at fault, or the second
        of two fields that both ask for one."""
        from ..structured import guided, one_of, response_format, structured_outputs

        return one_of({"response_format": response_format(self.response_format),
                       "structured_outputs": structured_outputs(self.structured_outputs),
                       **{f"guided_{kind}": guided(kind, getattr(self, f"guided_{kind}"), f"guided_{kind}")
                          for kind in ("json", "regex", "choice", "grammar")}})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> str | None:
        """The first parameter this request sets that specdraft does not support, else None."""
        return None

    def requested_logprobs(self) -> int | None:
        """The top tokens asked for at each output position (0: the token's own log-probability
        only), or None when the request asks for no log-probabilities."""
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
    #: the log-probability of each output token and of the N most likely there (OpenAI's legacy format)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.best_of not in (None, 1):
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class CompletionLogprobs(OpenAIBaseModel):
    """OpenAI's completions ``logprobs``: per output token its text, its log-probability, the
    ``logprobs`` most likely tokens there (and the token itself) as ``{text: logprob}``, and where
    its text starts in the answer's (the lengths of the tokens' texts before it, as vLLM counts)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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
    logprobs: CompletionLogprobs | None = None
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


# -- shared by /v1/chat/completions and /tokenize ---------------------------------------------


class ChatMessageParam(RequestModel):
    # system, developer, user, assistant or tool (the server checks it)
    role: str
    # a string, or a list of content parts of which only {"type": "text", "text": ...} is supported;
    # None only for an assistant's message
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # passed to the chat template (most templates leave it out)
    refusal: str | None = None  # what an assistant's message echoed back may hold: accepted when empty
    function_call: Any = None  # as refusal
    tool_calls: list[Any] | None = None  # an assistant's calls: [{"id", "type": "function", "function": {...}}]
    tool_call_id: str | None = None  # a tool message's: the call it answers


# -- /tokenize and /detokenize (vLLM's) ---------------------------------------------------------


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # as /v1/completions tokenizes a prompt


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True  # as /v1/chat/completions renders the messages
    add_special_tokens: bool = False  # the template has them
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # shown to the model as a chat request's are


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
