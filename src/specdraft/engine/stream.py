"""A request's output as it is accepted: :class:`Stream`, and the text of its tokens so far."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

from ..types import GenerationResult, TokenLogprob
from .sequence import Sequence, Status
from .output import INCOMPLETE, byte_fallback_ids, cleans_up_spaces, first_stop, output_text, stop_floor


@dataclass
class StreamChunk:
    """One burst of a request's output: the tokens one step accepted (1..K+1) and the text they
    complete (may be "": half a character, or what could still become a stop string, is held).
    ``logprobs``: a :class:`~specdraft.types.TokenLogprob` per token of ``token_ids`` when the
    request asked for them, else None."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class TextSoFar:
    """Text deltas of a growing token list whose concatenation is exactly the final text
    (:func:`~specdraft.engine.output.output_text`): what could still change is held back.

    Each delta decodes only the tokens past those already settled (and :attr:`CONTEXT` before
    them, for what the tokenizer makes of a boundary: a leading space, a character split over
    tokens), as vLLM's incremental detokenizer does, not the whole output again: the text is
    the settled text plus what that window adds to it. Where the window's text does not start
    with its settled part's (a tokenizer's clean-up changed text across the boundary), the
    whole output is decoded instead: the text is the whole output's decode wherever a later token
    rewrites text at most :attr:`CONTEXT` tokens back (tests/engine/test_text_so_far.py holds it to
    that on byte-level BPE, SentencePiece's byte fallback and clean-up's rewrites). A tokenizer
    that cleans up spaces (:func:`~specdraft.engine.output.cleans_up_spaces`) can take one out of the
    last three characters when the next token comes: those wait from their first space on; and a
    run of byte-fallback tokens at the end (:func:`~specdraft.engine.output.byte_fallback_ids`)
    waits for the token after it."""

    #: tokens decoded again before the settled ones, for the tokenizer's context at the boundary
    CONTEXT = 5
    #: new tokens past the settled ones before they settle (each settling decodes its context once)
    SETTLE = 16

    def __init__(self, tokenizer, stop: Seq[str] = (), *, min_tokens: int = 0, stop_token_ids: Seq[int] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.min_tokens, self.stop_token_ids = min_tokens, frozenset(stop_token_ids)
        self.emitted = ""
        self._floor: int | None = None  # stop_floor, once the tokens it reads are all there
        self._cleans_up = tokenizer is not None and cleans_up_spaces(tokenizer)
        held = frozenset() if tokenizer is None else byte_fallback_ids(tokenizer)
        # with the special tokens, which decode to nothing: a byte run goes on past them
        self._held = held | frozenset(tokenizer.all_special_ids) if held else held
        # tokens[:_settled] decode to _settled_text (a prefix of every later decode, so far);
        # tokens[_settled - CONTEXT:_settled] decode to _context_text
        self._settled, self._settled_text, self._context_text = 0, "", ""

    def delta(self, tokens: list[int], finish_reason: str | None = None) -> str:
        if self.tokenizer is None:
            return ""
        if finish_reason is not None:
            text = output_text(self.tokenizer, tokens, finish_reason, self.stop, min_tokens=self.min_tokens,
                               stop_token_ids=self.stop_token_ids)
        else:
            if tokens and tokens[-1] in self.stop_token_ids:  # it ends the request, and is not in the text
                tokens = tokens[:-1]
            end = len(tokens)
            while end and tokens[end - 1] in self._held:  # a byte run's text is not final before its end
                end -= 1
            text = self.decode(tokens[:end]).rstrip(INCOMPLETE)
            if self.stop:  # never past a stop string, and its start may be at the end: hold that back
                cut = first_stop(text, self.stop, self._stop_floor(tokens))
                text = text[:cut] if cut is not None else text[: max(0, len(text) - max(len(s) for s in self.stop) + 1)]
            if self._cleans_up:  # its patterns (" .", " 's", " ' ", " n't", ...) are at most four characters
                space = text.find(" ", max(0, len(text) - 3))
                text = text if space < 0 else text[:space]
        if not text.startswith(self.emitted):  # a tokenizer's clean-up changed earlier text: wait
            return ""
        out, self.emitted = text[len(self.emitted):], text
        return out

    def decode(self, tokens: list[int]) -> str:
        """``tokenizer.decode(tokens, skip_special_tokens=True)`` for a list that grew from the
        last call's, decoding the tokens past the settled ones (see the class)."""
        decode, text = self.tokenizer.decode, None
        if 0 < self._settled <= len(tokens):
            window = decode(tokens[max(0, self._settled - self.CONTEXT) :], skip_special_tokens=True)
            if window.startswith(self._context_text):
                text = self._settled_text + window[len(self._context_text) :]
        if text is None:  # nothing settled yet, or the boundary's text changed: the whole output
            text, self._settled = decode(tokens, skip_special_tokens=True), 0
        if len(tokens) - self._settled >= self.SETTLE and not text.endswith(INCOMPLETE):
            self._settled, self._settled_text = len(tokens), text
            self._context_text = decode(tokens[max(0, len(tokens) - self.CONTEXT) :], skip_special_tokens=True)
        return text

    def _stop_floor(self, tokens: list[int]) -> int:
        if self._floor is not None:
            return self._floor
        floor = stop_floor(self.tokenizer, tokens, self.min_tokens)
        if len(tokens) >= self.min_tokens - 1:
            self._floor = floor
        return floor


class Stream:
    """Iterate to get a request's output burst by burst (:class:`StreamChunk`); ``result`` holds the
    :class:`~specdraft.GenerationResult` once it has finished. ``close()`` (or leaving a ``with``
    block) stops the request at once if it is still running. Iteration raises the request's error
    (a :class:`~specdraft.errors.DrafterError` naming the drafter, say) if it failed.

    ``texts`` set False: the bursts carry no text (each ``text`` is ""), for a reader that wants
    only the result (whose text is whole), which then decodes its text once, at the end (:meth:`wait`
    reads so; the server's non-streamed replies too)."""

    def __init__(self, loop, seq: Sequence, tokenizer) -> None:
        self._loop, self.seq = loop, seq
        self.texts = True
        self._text = TextSoFar(tokenizer, seq.stop, min_tokens=seq.min_tokens, stop_token_ids=seq.stop_token_ids)
        self.result: GenerationResult | None = None
        self._done = False
        self._read = 0  # output tokens handed out so far (their logprobs are seq.output_logprobs[:_read])

    @property
    def prompt_tokens(self) -> int:
        return self.seq.prompt_len

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> StreamChunk:
        while not self._done:
            chunk = self._take(self.seq.events.get())
            if chunk is not None:
                return chunk
        raise StopIteration

    def wait(self) -> GenerationResult:
        """Wait for the end, making no bursts (so no text per burst); returns :attr:`result` (and
        raises the request's error, as iteration does)."""
        self.texts = False
        while not self._done:
            self._take(self.seq.events.get())
        return self.result

    def poll(self) -> StreamChunk | None:
        """The next burst if one has arrived, else None, without waiting; raises StopIteration at
        the end (and the request's error, as iteration does). With :meth:`on_ready`, a reader that
        holds no thread: the server's output loop."""
        while not self._done:
            event = self.seq.events.get_nowait()
            if event is None:
                return None
            chunk = self._take(event)
            if chunk is not None:
                return chunk
        raise StopIteration

    def on_ready(self, callback) -> None:
        """Run ``callback()`` whenever an event arrives for this stream (on the engine's thread, or
        the thread that closes it: keep it short); events that came before are :meth:`poll`'s too."""
        self.seq.events.on_put = callback

    def _take(self, event: tuple) -> StreamChunk | None:
        """The burst of one of the sequence's events (None: it ended with no text left)."""
        seq, (kind, tokens) = self.seq, event
        if kind == "tokens":
            start, self._read = self._read, self._read + len(tokens)
            logprobs = None if seq.logprobs is None else seq.output_logprobs[start : self._read]
            return StreamChunk(self._text.delta(seq.new_tokens) if self.texts else "", tokens, logprobs)
        self._done = True  # "done"
        if seq.error is not None:
            raise seq.error
        rest = self._text.delta(seq.new_tokens, seq.finish_reason)
        self.result = result_of(seq, self._text.emitted if self._text.tokenizer is not None else None)
        if rest and self.texts:
            return StreamChunk(rest, [], None if seq.logprobs is None else [])
        return None

    def close(self) -> None:
        """Stop the request if it is still running (its slot is freed before the next step)."""
        if self.seq.status is not Status.FINISHED:
            self._loop.abort(self.seq)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def result_of(seq: Sequence, text: str | None) -> GenerationResult:
    tokens = seq.new_tokens
    return GenerationResult(token_ids=tokens, text=text, finish_reason=seq.finish_reason, stats=seq.stats,
                            logprobs=None if seq.logprobs is None else seq.output_logprobs[: len(tokens)])
