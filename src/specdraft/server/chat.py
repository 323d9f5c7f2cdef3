"""``/v1/chat/completions``: how its request is read (messages through the chat template) and its
answer shaped (the assistant's message, streamed as deltas)."""

from __future__ import annotations

from typing import Any, Callable

from .errors import APIError
from .logprobs import ChatFormat
from .chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
)
from .protocol import CHAT_DEFAULT_MAX_TOKENS
from .serving import Reply

#: chat roles a message may have; "developer" is passed to the template as "system"
CHAT_ROLES = ("system", "developer", "user", "assistant")


class ChatCompletion(Reply):
    """``/v1/chat/completions``: messages through the chat template; a choice is the assistant's
    message, streamed as deltas after one that gives the role."""

    request, response, stream_response = ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse
    id_prefix, default_max_tokens, prompt_param = "chatcmpl", CHAT_DEFAULT_MAX_TOKENS, "messages"
    logprob_format = ChatFormat

    @staticmethod
    def encoder(body: ChatCompletionRequest, decoder, check_length) -> Callable[[], list[int]]:
        messages = chat_messages(body)
        options = template_kwargs(body.chat_template_kwargs)
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


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` (the decoder refuses the names that are not template variables)."""
    return dict(kwargs or {})


def chat_messages(body) -> list[dict[str, str]]:
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
