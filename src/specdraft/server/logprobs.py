"""Log-probabilities in OpenAI's shapes, whole and streamed.

The engine hands over a :class:`~specdraft.types.TokenLogprob` per output token
(:mod:`specdraft.engine.logprobs`); here they become chat's ``logprobs.content`` (:class:`ChatFormat`)
or completions' ``logprobs`` (:class:`CompletionFormat`), and a stream's entries are handed out
with the text they belong to (:class:`StreamedLogprobs`).

A token's text is its bytes as the tokenizer holds them (a byte-level BPE token may be part of a
character: its ``bytes`` are exact, its ``token`` text has U+FFFD for the incomplete part), and
a log-probability of -inf (a token the sampling settings filter out, among the top N) is sent as
-9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..engine.output import INCOMPLETE
from ..types import TokenLogprob
from .chat_protocol import ChatChoiceLogprobs, ChatCompletionTokenLogprob, TopLogprob
from .protocol import CompletionLogprobs

#: what -inf is sent as (vLLM's value)
LOGPROB_FLOOR = -9999.0
#: a streamed chunk's tokens are checked this many tokens back from the newest for whether the
#: text sent so far completes them (held-back text is short: part of a character, a stop string)
LOOKBACK = 32


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR) if not math.isnan(logprob) else LOGPROB_FLOOR


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte's character in a byte-level BPE vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class TokenTexts:
    """Each token id's text and UTF-8 bytes for ``tokenizer`` (a transformers tokenizer), looked up
    once: a byte-level BPE's token through its byte alphabet, a SentencePiece byte token
    (``<0xE2>``) as its byte, any other as the tokenizer decodes it alone."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._known: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = None
        if type(decoder).__name__ == "ByteLevel":
            self._byte_level = {c: b for b, c in _bytes_to_unicode().items()}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._look_up(token_id)
        return known

    def text(self, token_id: int) -> str:
        return self(token_id)[0]

    def _look_up(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level is not None and all(c in self._byte_level for c in piece):
                raw = bytes(self._byte_level[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), list(raw)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece's byte fallback
                try:
                    raw = bytes([int(piece[3:5], 16)])
                except ValueError:
                    raw = None
                if raw is not None:
                    return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8", errors="replace"))


class ChatFormat:
    """Chat's ``choices[].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}]}]}``, one entry per output token."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text, raw = self.texts(token_id)
        return TopLogprob(token=text, logprob=_finite(logprob), bytes=raw)

    def __call__(self, entries: Sequence[TokenLogprob]) -> ChatChoiceLogprobs:
        content = []
        for e in entries:
            text, raw = self.texts(e.token_id)
            content.append(ChatCompletionTokenLogprob(token=text, logprob=_finite(e.logprob), bytes=raw,
                                                      top_logprobs=[self._top(i, lp) for i, lp in e.top]))
        return ChatChoiceLogprobs(content=content)


class CompletionFormat:
    """Completions' ``choices[].logprobs``: ``{tokens, token_logprobs, top_logprobs: [{text: logprob}],
    text_offset}``; the top tokens' dict also holds the output token (OpenAI's "up to logprobs + 1"),
    and a token's offset is the length of the tokens' texts before it in the answer (vLLM's
    count), carried from one streamed chunk to the next."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def __call__(self, entries: Sequence[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for e in entries:
            text = self.texts.text(e.token_id)
            top = {self.texts.text(i): _finite(lp) for i, lp in e.top}
            top.setdefault(text, _finite(e.logprob))
            out.tokens.append(text)
            out.token_logprobs.append(_finite(e.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


class StreamedLogprobs:
    """A streamed answer's entries, each handed out with the chunk whose text completes its
    token's: :meth:`add` takes a burst (:class:`~specdraft.engine.StreamChunk`) and returns the
    entries of the tokens whose text the text sent so far now holds in full; tokens whose text
    is held back (part of a character, what could be a stop string) wait for the chunk that
    releases it, and :meth:`rest` returns what is left at the end (end-of-sequence, a stop token,
    tokens after a stop string). Every entry is handed out once, in order."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.entries: list[TokenLogprob] = []
        self.text = ""
        self.sent = 0

    def add(self, chunk) -> list[TokenLogprob]:
        self.tokens += chunk.token_ids
        self.entries += chunk.logprobs or []
        self.text += chunk.text
        if not chunk.text:
            return []
        for done in range(len(self.tokens), max(self.sent, len(self.tokens) - LOOKBACK), -1):  # newest first
            if self._complete(done):
                out, self.sent = self.entries[self.sent : done], done
                return out
        return []

    def rest(self) -> list[TokenLogprob]:
        out, self.sent = self.entries[self.sent:], len(self.entries)
        return out

    def _complete(self, n: int) -> bool:
        """Whether the text sent so far holds the text of the first ``n`` tokens in full."""
        text = self.tokenizer.decode(self.tokens[:n], skip_special_tokens=True)
        return not text.endswith(INCOMPLETE) and self.text.startswith(text)


__all__ = ["ChatFormat", "CompletionFormat", "LOGPROB_FLOOR", "StreamedLogprobs", "TokenTexts"]
