"""``/v1/chat/completions``: how its request is read (messages through the chat template) and its
answer shaped (the assistant's message, streamed as deltas)."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import ConfigError
from ..tools import ContentDelta, ToolStream, calls_finish_reason, template_messages
from .errors import APIError
from .logprobs import ChatFormat
from .chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from .protocol import CHAT_DEFAULT_MAX_TOKENS
from .serving import Reply, openai_finish_reason

#: chat roles a message may have; "developer" is passed to the template as "system"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatCompletion(Reply):
    """``/v1/chat/completions``: messages through the chat template; a choice is the assistant's
    message, streamed as deltas after one that gives the role."""

    request, response, stream_response = ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse
    id_prefix, default_max_tokens, prompt_param = "chatcmpl", CHAT_DEFAULT_MAX_TOKENS, "messages"
    logprob_format = ChatFormat

    def __init__(self, model: str, texts=None) -> None:
        super().__init__(model, texts)
        self.tools = None  # the request's ToolRequest (prepare): None without tools
        self._parser: str | None = None
        self._readers: dict[int, ToolStream] = {}  # choice index -> the reader of its calls

    @staticmethod
    def encoder(body: ChatCompletionRequest, decoder, check_length) -> Callable[[], list[int]]:
        messages = chat_messages(body)
        options = template_kwargs(body.chat_template_kwargs)
        tools = body.tool_request()
        extra = {} if tools is None else {"tools": tools}
        return lambda: decoder.encode_chat(messages, options, check_text=lambda text: check_length(text, "messages"),
                                           **extra)

    def prepare(self, body: ChatCompletionRequest, decoder) -> None:
        """The request's tools, and a reader of calls for each choice (ConfigError: ``auto`` for a
        model whose call format is unknown)."""
        self.tools = body.tool_request()
        self._parser = getattr(decoder, "tool_call_parser", None)  # the tests' stand-in decoder has none
        if self.tools is not None:
            self.tools.stream(self._parser)  # a request the parser cannot read fails before it runs

    def _reader(self, index: int) -> ToolStream | None:
        if self.tools is None:
            return None
        if index not in self._readers:
            self._readers[index] = self.tools.stream(self._parser)
        return self._readers[index]

    def chunk_choices(self, chunk, index: int) -> list:
        reader = self._reader(index)
        if reader is None:
            return super().chunk_choices(chunk, index)
        return self._delta_choices(reader.add(chunk.text or ""), index, self.chunk_logprobs(chunk, index))

    def closing_choices(self, index: int, result) -> list:
        reader = self._reader(index)
        if reader is None:
            return super().closing_choices(index, result)
        choices = self._delta_choices(reader.end(), index, None)
        last = self.stream_choice(None, self._finish_reason(result, reader.calls),
                                  logprobs=self.chunk_logprobs(index=index))
        last.index = index
        return choices + [last]

    def whole_choice(self, index: int, result) -> ChatCompletionResponseChoice:
        reader = self._reader(index)
        if reader is None:
            return super().whole_choice(index, result)
        content, calls = reader.read(result.text or "")
        message = ChatMessage(content=content, tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None)
        return ChatCompletionResponseChoice(message=message, finish_reason=self._finish_reason(result, len(calls)))

    def _finish_reason(self, result, calls: int) -> str:
        reason = calls_finish_reason(result.finish_reason, calls, self.tools)
        return reason if reason == "tool_calls" else openai_finish_reason(result)

    @staticmethod
    def _delta_choices(deltas: list, index: int, logprobs) -> list:
        """A streamed choice per delta (text, or a piece of a call); the logprobs on the first (or
        on an empty delta when the text is held back)."""
        choices = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                message = DeltaMessage(content=delta.text)
            else:
                call = DeltaToolCall(index=delta.index, id=delta.id, type="function" if delta.id else None,
                                     function=DeltaFunctionCall(name=delta.name, arguments=delta.arguments))
                message = DeltaMessage(tool_calls=[call])
            choices.append(ChatCompletionResponseStreamChoice(index=index, delta=message))
        if logprobs is not None and logprobs.content:
            if not choices:
                choices.append(ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage()))
            choices[0].logprobs = logprobs
        return choices

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


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` (the decoder refuses the names that are not template variables)."""
    return dict(kwargs or {})


def chat_messages(body) -> list[dict[str, Any]]:
    """The messages as ``[{"role", "content"}]`` for the chat template, with ``name``, an
    assistant's ``tool_calls`` and a tool result's ``tool_call_id`` where given; text content
    parts are joined with newlines. APIError (400, naming the field) for a role other than system,
    developer, user, assistant and tool, for null content outside an assistant's message, for
    parts other than text (images, audio), for a tool message without ``tool_call_id``, and for
    the deprecated ``function_call`` or a refusal echoed back in an assistant's message."""
    messages = []
    for i, message in enumerate(body.messages):
        at, role, content = f"messages.{i}", message.role, message.content
        if role not in CHAT_ROLES:
            hint = " (OpenAI's deprecated function messages: send tool messages)" if role == "function" else ""
            raise APIError(400, f"{at}.role: unknown role {role!r}; use one of {', '.join(CHAT_ROLES)}{hint}",
                           param=f"{at}.role")
        for name in ("function_call", "refusal"):
            if getattr(message, name) not in (None, []):
                raise APIError(400, f"{at}.{name}: not supported by specdraft's server; send the message's text as "
                                    "its content (and calls as tool_calls)", param=f"{at}.{name}",
                               code="unsupported_parameter")
        if message.tool_calls and role != "assistant":
            raise APIError(400, f"{at}.tool_calls: only an assistant's message has tool calls", param=f"{at}.tool_calls")
        if (message.tool_call_id is not None) != (role == "tool"):
            what = "a tool message needs tool_call_id (the id of the call it answers)" if role == "tool" else \
                "only a tool message has tool_call_id"
            raise APIError(400, f"{at}.tool_call_id: {what}", param=f"{at}.tool_call_id")
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
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    try:
        template_messages(messages)  # the calls' shape and arguments, checked here to name the field
    except ConfigError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    return messages
