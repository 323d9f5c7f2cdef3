"""A bound on how much text one token can cover, to refuse a prompt too long for the context
without tokenizing it.

A prompt of ``N`` characters has at least ``ceil(N / C)`` tokens when no token covers more than
``C`` of its characters. For a byte-level BPE tokenizer (GPT-2's family: SmolLM2, Llama 3, Qwen,
...) or a BPE with byte fallback (Llama 2's, Mistral's), every character of the text ends up in
some token (none is dropped, none becomes an ``<unk>`` that swallows a run of them), and a token
covers at most as many characters as its string in the vocabulary has (a byte-level token's
string has one character per byte, and a character is at least one byte; a special token matches
its own text). So ``C`` is the longest string in the vocabulary, times what the normalizer can
shrink the text by: Unicode composition (NFC, NFKC) merges at most 4 characters into one, and a
``Replace`` of a string by a shorter one shrinks by their ratio.

Any other tokenizer gets no bound: a slow one, word-level or WordPiece models (whose ``<unk>``
covers a whole word), pre-tokenizers that drop whitespace, normalizers that strip text, special
tokens that swallow the whitespace beside them (``lstrip`` / ``rstrip``). Its prompts are
tokenized whole and checked after (the request-body limit still caps that work).
"""

from __future__ import annotations

import json
import logging
import math

from .errors import ConfigError

logger = logging.getLogger("specdraft")

#: the most characters Unicode canonical composition (NFC, NFKC) turns into one (e.g. U+1FAF
#: from Omega and three combining marks)
COMPOSITION_SHRINK = 4
#: pre-tokenizers that keep every character of the text ("Split" and "Punctuation" unless their
#: behavior is "removed")
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def chars_per_token(tokenizer) -> int | None:
    """The most characters of a text one token of ``tokenizer`` can cover (see the module's
    docstring), or None where no sound bound is known."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        state = json.loads(backend.to_str())
        model = state.get("model") or {}
        if model.get("type") != "BPE":
            return None
        pre = _components(state.get("pre_tokenizer"), "pretokenizers")
        if pre is None or any(p.get("type") not in _KEEPING_PRE_TOKENIZERS
                              or str(p.get("behavior", "")).lower() == "removed" for p in pre):
            return None
        if not model.get("byte_fallback") and not any(p.get("type") == "ByteLevel" for p in pre):
            return None  # characters outside the vocabulary would be dropped or fused into one <unk>
        if any(t.get("lstrip") or t.get("rstrip") for t in state.get("added_tokens") or []):
            return None  # such a token also swallows the whitespace beside it, however long
        shrink = _normalizer_shrink(state.get("normalizer"))
        if shrink is None:
            return None
        longest = max(len(token) for token in tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer we cannot read: no bound, as for an unknown kind
        logger.debug("no characters-per-token bound for this tokenizer", exc_info=True)
        return None
    return math.ceil(longest * shrink)


def check_fits(text: str, what: str, per_token: int | None, context: int) -> None:
    """ConfigError (one line, naming ``what``) when the length of ``text`` alone shows it has more
    tokens than ``context`` holds, no token covering more than ``per_token`` characters (None: no
    bound, nothing checked). The CLI and the server refuse a prompt this way before tokenizing it
    (a 20 MB text takes the tokenizer seconds and gigabytes)."""
    if per_token is None:
        return
    at_least = -(-len(text) // per_token)
    if at_least >= context:
        raise ConfigError(f"{what} has at least {at_least} tokens ({len(text)} characters, and no token of this "
                          f"model covers more than {per_token}) but the model's context holds {context}; shorten it "
                          f"to fewer than {context} tokens")


def _components(node, key: str) -> list[dict] | None:
    """A normalizer's or pre-tokenizer's parts (a ``Sequence`` flattened; [] for none)."""
    if node is None:
        return []
    if not isinstance(node, dict):
        return None
    if node.get("type") == "Sequence":
        parts = []
        for child in node.get(key) or []:
            flat = _components(child, key)
            if flat is None:
                return None
            parts.extend(flat)
        return parts
    return [node]


def _normalizer_shrink(node) -> float | None:
    """By how much (at most) the normalizer shortens a text; None: it may drop text."""
    parts = _components(node, "normalizers")
    if parts is None:
        return None
    shrink = 1.0
    for part in parts:
        kind = part.get("type")
        if kind in ("NFC", "NFKC"):
            shrink *= COMPOSITION_SHRINK
        elif kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):
            pass  # decomposition, case and prefixes never shorten the text
        elif kind == "Replace":
            pattern, content = part.get("pattern") or {}, part.get("content")
            if "String" not in pattern or not isinstance(content, str) or not content or not pattern["String"]:
                return None  # a regex, or a replacement by nothing: unbounded
            shrink *= max(1.0, len(pattern["String"]) / len(content))
        else:  # Strip, StripAccents, BertNormalizer, Precompiled (SentencePiece's), ...: may drop text
            return None
    return shrink


#: The most tokens one round may draft: acceptance of the 16th drafted token is negligible
#: for any drafter measured, and a verify pass that wide costs several plain steps.
MAX_SPEC_LENGTH = 16


def check_spec_length(spec_length) -> None:
    """The most tokens a round drafts (a decoder's setting), or ConfigError."""
    if isinstance(spec_length, bool) or not isinstance(spec_length, int) or not 1 <= spec_length <= MAX_SPEC_LENGTH:
        raise ConfigError(f"spec_length must be an integer from 1 to {MAX_SPEC_LENGTH} (got {spec_length!r}); "
                          "4-6 suits most drafters", param="spec_length")
