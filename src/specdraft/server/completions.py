"""``/v1/completions``: how its request is read (a raw prompt: text or token ids) and its answer shaped."""

from __future__ import annotations

from typing import Callable

from .errors import APIError
from .logprobs import CompletionFormat
from .protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from .serving import Reply


class Completion(Reply):
    """``/v1/completions``: a raw prompt (text or token ids); a choice is the text."""

    request, response, stream_response = CompletionRequest, CompletionResponse, CompletionStreamResponse
    id_prefix, default_max_tokens, prompt_param = "cmpl", COMPLETION_DEFAULT_MAX_TOKENS, "prompt"
    logprob_format = CompletionFormat

    @staticmethod
    def encoder(body: CompletionRequest, decoder, check_length) -> Callable[[], list[int]]:
        prompt = completion_prompt(body.prompt)
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


def completion_prompt(prompt) -> str | list[int]:
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
