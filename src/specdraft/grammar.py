"""Grammars for structured output: a :class:`GrammarSpec` (what a request asks for), compiled per
tokenizer (:class:`GrammarCompiler`, llguidance's; the most recently used kept) into a
:class:`Grammar`, of which each request gets a :class:`GrammarMatcher`: llguidance's matcher over
the tokens it has committed. How users ask for one: :mod:`specdraft.structured`; how the engine
masks the target's distribution with the matchers: :mod:`specdraft.engine.processors`.

A round's masks (:meth:`GrammarMatcher.fill`), one per pass index of the row:

- index 0 (after the last committed token): the matcher's own state;
- a chain's index ``j``: the state after ``d_1..d_j``, the matcher advanced along the draft and
  rolled back afterwards;
- a tree's node: the state after its ancestors' tokens and its own (the matcher moved from node
  to node by rolling back to the common ancestor and advancing);
- a node whose token the grammar forbids (or an end token: the request ends there) makes its
  descendants unreachable; their indices keep their logits (acceptance never reads them past a
  rejected node, and they must not be all -inf, or a softmax over them would be NaN).

That is plain decoding's distribution under the grammar at every position a draft can reach,
so acceptance stays as it is: a forbidden draft has target probability 0 and is rejected
(greedy: it is never the argmax), and the output is exactly what plain decoding under the
grammar gives, greedy and sampled. After the round, :meth:`GrammarMatcher.advance` moves each
matcher over the committed tokens.

The end of the output: where the grammar may end, the row's end tokens (EOS and its
``stop_token_ids``) are allowed; once it is complete, only they are. ``min_tokens`` holds the end
tokens back only while the grammar allows some other token: where it allows nothing else, they
come back (the request ends, as the engine's ``_finish_reason`` knows).

llguidance was picked over xgrammar by measurement (docs/algorithm.md, "Structured output").
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ConfigError

#: what to install for structured output (the ``structured`` extra: llguidance)
INSTALL_HINT = "pip install 'specdraft[structured]'"
#: the kinds of grammar a :class:`GrammarSpec` holds
KINDS = ("json_schema", "regex", "choice", "grammar")
#: compiled grammars kept per decoder
CACHE_SIZE = 64


#: the longest grammar text (a schema as JSON, a regex, a choice list, a grammar) a request may send:
#: its compile and its masks grow with it, and a round waits for every row's masks
MAX_GRAMMAR_CHARS = 100_000
#: llguidance's parser holds at most 2,000 items in a row: 2,100 choices sharing a beginning failed
#: after a few tokens ("Current row has 2101 items"), which no check at compile sees
MAX_CHOICES = 1000
#: a regex's counted repetition (``{n}``, ``{n,m}``): ``b{1000000}`` failed after a few tokens
#: ("too many expressions constructed")
MAX_REGEX_REPEAT = 10_000
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class GrammarSpec:
    """The output a request must match: ``kind`` (one of :data:`KINDS`) and ``source``, its text
    (a JSON schema as JSON, a regular expression, a JSON list of the strings to choose from, a
    Lark or GBNF grammar). ``field`` is the request field it came from, named in errors; it is
    not part of the spec's identity (the compile cache's key)."""

    kind: str
    source: str
    field: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"{self.field}: unknown grammar kind {self.kind!r}; one of {', '.join(KINDS)}",
                              param=self.field)
        if not isinstance(self.source, str):
            raise ConfigError(f"{self.field}: the grammar must be text, got {type(self.source).__name__}",
                              param=self.field)
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ConfigError(f"{self.field}: the {self.kind.replace('_', ' ')} has {len(self.source)} characters; "
                              f"at most {MAX_GRAMMAR_CHARS} are served", param=self.field)
        if self.kind == "choice":
            try:
                items = len(json.loads(self.source))
            except (ValueError, TypeError):
                items = 0  # not a list: the compile says so
            if items > MAX_CHOICES:
                raise ConfigError(f"{self.field}: {items} choices; at most {MAX_CHOICES} are served (the grammar "
                                  "engine fails on more partway through an answer)", param=self.field)
        if self.kind == "regex":
            counts = [int(n) for m in _REPEAT.finditer(self.source) for n in m.groups() if n]
            if counts and max(counts) > MAX_REGEX_REPEAT:
                raise ConfigError(f"{self.field}: the regex repeats {max(counts)} times; at most {MAX_REGEX_REPEAT} "
                                  "are served (the grammar engine fails on more partway through an answer)",
                                  param=self.field)


def _llguidance(what: str):
    try:
        import llguidance
    except ImportError:
        raise ConfigError(f"{what}: structured output needs the llguidance package, which is not installed: "
                          f"{INSTALL_HINT}", param=what) from None
    return llguidance


def available() -> bool:
    """Whether structured output can run here (llguidance is installed)."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _ll_tokenizer(llguidance, tokenizer, vocab_size: int, eos_token_ids, what: str):
    """llguidance's view of a Hugging Face fast tokenizer, ``vocab_size`` ids wide (or the
    tokenizer's size, when it has more)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"{what}: structured output needs a fast (Rust) Hugging Face tokenizer; this model's is "
                          f"{type(tokenizer).__name__}", param=what)
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos = list(eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    try:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=max(vocab_size, len(tokenizer)),
                                      eos_token=eos or None)
    except Exception as exc:  # noqa: BLE001 - llguidance's own complaint, in one line
        raise ConfigError(f"{what}: llguidance cannot read this model's tokenizer: {_first_line(exc)}",
                          param=what) from None


def _first_line(text) -> str:
    """llguidance's message in one line: its first line, and the line saying what is wrong when
    that comes later (a regex's error, below a picture of where it is)."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    why = next((line for line in lines[1:] if line.startswith("error:")), None)
    return lines[0] + (f" {why}" if why else "")


def _grammar_text(llguidance, spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec`` (ConfigError naming its field when it cannot be read)."""
    matcher = llguidance.LLMatcher
    try:
        if spec.kind == "json_schema":
            return matcher.grammar_from_json_schema(spec.source)
        if spec.kind == "regex":
            return matcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            return llguidance.grammar_from("choice", spec.source)
        return llguidance.grammar_from("grammar", spec.source)  # Lark, or GBNF (llama.cpp's, vLLM's EBNF)
    except Exception as exc:  # noqa: BLE001 - a malformed schema or grammar, in one line
        raise ConfigError(f"{spec.field}: invalid {spec.kind.replace('_', ' ')}: {_first_line(exc)}",
                          param=spec.field) from None


def check_spec(spec: GrammarSpec) -> None:
    """ConfigError (naming ``spec.field``) unless llguidance is installed and ``spec`` is a valid
    schema, regex or grammar; what does not depend on the tokenizer, before any model loads."""
    llguidance = _llguidance(spec.field)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_grammar_text(llguidance, spec))
    if failed:
        raise ConfigError(f"{spec.field}: invalid {spec.kind.replace('_', ' ')}: {_first_line(messages[0])}",
                          param=spec.field)


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one tokenizer and vocabulary (llguidance); the
    :data:`CACHE_SIZE` most recently used stay compiled, so a spec asked for again (a server's
    clients tend to send the same schema) is compiled once. Any thread may call :meth:`compile`.

    Raises ConfigError (:data:`INSTALL_HINT`) when llguidance is not installed."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=(), cache_size: int = CACHE_SIZE) -> None:
        self._llg = _llguidance("response_format")
        self.tokenizer = _ll_tokenizer(self._llg, tokenizer, vocab_size, eos_token_ids, "response_format")
        #: the special tokens' texts (``<|im_end|>``): a grammar that spells one is refused
        self.specials = special_texts(tokenizer)
        self.vocab_size = self.tokenizer.vocab_size  # the masks' width (>= the logits')
        self.cache_size = cache_size
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> "Grammar":
        """``spec`` compiled (from the cache when it is there); ConfigError naming ``spec.field``
        when it is not a valid schema, regex or grammar."""
        with self._lock:
            template = self._compiled.get(spec)
            if template is not None:
                self._compiled.move_to_end(spec)
                return Grammar(spec, template, self)
        self._check_specials(spec)
        text = _grammar_text(self._llg, spec)
        matcher_type = self._llg.LLMatcher
        failed, messages = matcher_type.validate_grammar_with_warnings(text, self.tokenizer)
        if failed:
            raise ConfigError(f"{spec.field}: invalid {spec.kind.replace('_', ' ')}: {_first_line(messages[0])}",
                              param=spec.field)
        template = matcher_type(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise ConfigError(f"{spec.field}: invalid {spec.kind.replace('_', ' ')}: "
                              f"{_first_line(template.get_error())}", param=spec.field)
        self._check_start(spec, template)
        with self._lock:
            self._compiled[spec] = template
            self._compiled.move_to_end(spec)
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return Grammar(spec, template, self)

    def _check_specials(self, spec: GrammarSpec) -> None:
        """A grammar whose text spells a special token (``<|im_end|>``, escaped or not) is
        refused: llguidance reads it as the token, which ends the answer (a choice of
        "<|im_end|>" answered ""), not as text."""
        if spec.kind == "json_schema":  # a schema's text is mostly descriptions, not output
            return
        source = spec.source.replace("\\", "")
        for text in self.specials:
            if text in source:
                raise ConfigError(f"{spec.field}: the {spec.kind.replace('_', ' ')} spells the special token "
                                  f"{text!r}, which the model emits as a token, not as text; leave it out",
                                  param=spec.field)

    def _check_start(self, spec: GrammarSpec, template) -> None:
        """The first mask, computed now (on a copy): a grammar past llguidance's limits fails
        there, and one that allows no token at its start accepts no string at all; either is a
        ConfigError naming ``spec.field``, and is never cached."""
        trial = template.deep_copy()
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
        trial.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        kind = spec.kind.replace("_", " ")
        if trial.is_error():
            raise ConfigError(f"{spec.field}: this {kind} is past what the grammar engine can serve: "
                              f"{_first_line(trial.get_error())}", param=spec.field)
        if not words.any():
            raise ConfigError(f"{spec.field}: this {kind} accepts no text at all (nothing can start it); "
                              "check its references and alternatives", param=spec.field)

    def forget(self, spec: GrammarSpec) -> None:
        """Drop ``spec``'s compiled grammar from the cache (a request's matcher failed on it: the
        next request compiles it afresh rather than sharing whatever state failed)."""
        with self._lock:
            self._compiled.pop(spec, None)

    def copy_of(self, template):
        with self._lock:
            return template.deep_copy()


@dataclass(frozen=True)
class Grammar:
    """A compiled :class:`GrammarSpec`: :meth:`matcher` gives each request a matcher of its own."""

    spec: GrammarSpec
    template: Any  # llguidance.LLMatcher in its start state, never advanced
    compiler: GrammarCompiler

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self.compiler.copy_of(self.template), self.compiler.tokenizer.eos_token,
                              self.compiler.vocab_size, on_error=lambda: self.compiler.forget(self.spec))


def special_texts(tokenizer) -> tuple[str, ...]:
    """The texts of ``tokenizer``'s control tokens: its BOS and EOS, and special tokens shaped
    ``<|...|>`` (ChatML's, Llama 3's). Special tokens that read as words (``<filename>``) are left
    out: a schema's description may well say them."""
    control = {getattr(tokenizer, name, None) for name in ("bos_token", "eos_token")}
    texts = control | set(getattr(tokenizer, "all_special_tokens", ()) or ())
    texts |= {str(added.content) for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
              if getattr(added, "special", False)}
    return tuple(sorted(t for t in texts if isinstance(t, str) and len(t) >= 2
                        and (t in control or (t.startswith("<|") and t.endswith("|>")))))


def _bit(words: np.ndarray, token: int) -> bool:
    """Whether ``token``'s bit is set in a mask row ``words # [vocab / 32]`` uint32."""
    return bool(int(words[token >> 5]) >> (token & 31) & 1)


def _set_bit(words: np.ndarray, token: int) -> None:
    if token >> 5 < words.shape[0]:
        words[token >> 5] |= np.uint32(1 << (token & 31))


class GrammarMatcher:
    """One request's place in its grammar: llguidance's matcher over the tokens it has committed.
    :meth:`fill` writes the masks of a round's pass indices (advancing along the draft and rolling
    back); :meth:`advance` moves it over the committed tokens. ``error`` is llguidance's message
    once it failed (a grammar too complex for its limits, say); its masks then allow only the end
    tokens, so the request ends."""

    def __init__(self, matcher, eos_token: int, width: int, on_error=None) -> None:
        self._matcher = matcher
        self._eos = eos_token  # llguidance's EOS: its bit says whether the grammar may end here
        self.width = width  # token ids its masks cover: (width + 31) // 32 words
        self.error: str | None = None
        self._on_error = on_error  # called once, when the matcher fails

    @property
    def done(self) -> bool:
        """Whether the grammar is complete: nothing but an end token may follow."""
        return bool(self._matcher.is_stopped())

    def fill(self, bits: np.ndarray, tokens: list[int], parents: list[int] | None, ends) -> bool:
        """Write ``bits[0]`` (the mask after the committed tokens) and ``bits[i + 1]`` (after node
        ``i`` and its ancestors) for a round's draft: ``tokens[i]`` is node ``i``'s token,
        ``parents[i]`` its parent (-1: the last committed token; -2: none, an invalid node;
        ``parents`` None: a chain, node ``i``'s parent is ``i - 1``). ``bits # [>= len(tokens) + 1,
        words]`` uint32; ``ends`` the row's end tokens. Indices no draft can reach get every bit
        set. The matcher ends where it started. Returns False when the matcher has failed (see
        ``error``): then only the end tokens are allowed at index 0."""
        if self.error is None and self._matcher.is_error():
            self.error = _first_line(self._matcher.get_error())
        if self.error is None:
            try:
                self._fill(bits, tokens, parents, ends)
                return True
            except RuntimeError as exc:  # the matcher refused a token its own mask allowed, or a mask was empty
                self.error = _first_line(exc)
        if self._on_error is not None:
            self._on_error()
            self._on_error = None
        bits[0] = 0
        for t in ends:
            _set_bit(bits[0], t)
        bits[1 : len(tokens) + 1] = np.uint32(0xFFFFFFFF)
        return False

    def _fill(self, bits: np.ndarray, tokens: list[int], parents: list[int] | None, ends) -> None:
        m = self._matcher
        self._mask(bits[0], ends)
        reachable = [False] * len(tokens)
        stack: list[int] = []  # the nodes the matcher has consumed beyond the committed tokens, root first
        try:
            for i, token in enumerate(tokens):
                parent = i - 1 if parents is None else parents[i]
                if not ((parent == -1 or (parent >= 0 and reachable[parent])) and _bit(bits[parent + 1], token)
                        and token not in ends):
                    bits[i + 1] = np.uint32(0xFFFFFFFF)  # unreachable: past a forbidden or a final token
                    continue
                if parents is None:
                    path = list(range(i + 1))
                else:
                    path = [i]
                    while parents[path[-1]] >= 0:
                        path.append(parents[path[-1]])
                    path.reverse()
                common = 0  # how much of the path the matcher has consumed already
                while common < min(len(stack), len(path)) and stack[common] == path[common]:
                    common += 1
                if len(stack) > common:
                    m.rollback(len(stack) - common)
                    del stack[common:]
                for node in path[common:]:
                    if not m.consume_token(tokens[node]):
                        raise RuntimeError(m.get_error())
                    stack.append(node)
                reachable[i] = True
                self._mask(bits[i + 1], ends)
        finally:
            if stack and not m.is_error():
                m.rollback(len(stack))

    def _mask(self, words: np.ndarray, ends) -> None:
        """The mask of the matcher's state into ``words``, the end tokens allowed where the grammar
        may end. A mask that allows nothing (the grammar cannot go on, nor end) raises: the request
        then ends with an error, never with an end token the grammar did not allow."""
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self._matcher.is_error():
            raise RuntimeError(self._matcher.get_error())
        if not words.any():
            raise RuntimeError("the grammar allows no token here and cannot end here either")
        if _bit(words, self._eos):  # the grammar may end here
            for t in ends:
                _set_bit(words, t)

    def advance(self, tokens: list[int]) -> None:
        """Consume ``tokens`` (a round's committed ones); a failure is kept in ``error``."""
        if self.error is None and not self._matcher.consume_tokens(list(tokens)):
            self.error = _first_line(self._matcher.get_error())
            if self._on_error is not None:
                self._on_error()
                self._on_error = None


__all__ = ["CACHE_SIZE", "INSTALL_HINT", "KINDS", "Grammar", "GrammarCompiler", "GrammarMatcher", "GrammarSpec",
           "available", "check_spec"]
