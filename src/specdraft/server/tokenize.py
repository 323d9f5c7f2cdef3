"""vLLM's ``/tokenize`` and ``/detokenize`` routes (a mixin of the app's server, :mod:`.app`)."""

from __future__ import annotations

from fastapi import Request

from ..errors import ConfigError
from .bodies import parse, read_json, validate
from ..tools import read_tools
from .chat import chat_messages, template_kwargs
from .errors import APIError, config_param
from .protocol import DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse


class TokenizeRoutes:
    """The routes; the server supplies ``decoder``, ``max_request_bytes``, ``check_served``,
    ``tokenizer()``, ``check_length``, ``blocking`` and ``error``."""

    async def tokenize(self, request: Request):
        """vLLM's ``/tokenize``: ``{"prompt"}`` as completions tokenize it, or ``{"messages"}`` as
        chat completions render and tokenize them; ``{"tokens", "count", "max_model_len"}``."""
        try:
            data = await read_json(request, self.max_request_bytes)
            body = validate(data, TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest)
            self.check_served(body)
            tokenizer = self.tokenizer()
            if isinstance(body, TokenizeChatRequest):
                messages = chat_messages(body)
                options = {"add_generation_prompt": body.add_generation_prompt,
                           **template_kwargs(body.chat_template_kwargs)}

                def encode() -> list[int]:
                    tools = {} if body.tools is None else {"tools": read_tools(body.tools)}
                    return self.decoder.encode_chat(messages, options, add_special_tokens=body.add_special_tokens,
                                                    check_text=lambda text: self.check_length(text, "messages"),
                                                    **tools)
            else:
                self.check_length(body.prompt, "prompt")

                def encode() -> list[int]:
                    return list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)

            try:
                ids = await self.blocking(encode)
            except ConfigError as exc:
                raise APIError(400, str(exc), param=config_param(exc, "messages")) from None
            return TokenizeResponse(count=len(ids), max_model_len=self.decoder.target.max_context,
                                    tokens=ids).model_dump()
        except Exception as exc:
            return self.error(exc).response()

    async def detokenize(self, request: Request):
        """vLLM's ``/detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
        try:
            body = await parse(request, DetokenizeRequest, self.max_request_bytes)
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
