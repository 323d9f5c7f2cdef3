"""Prefix caching: the keys and values of prompt prefill passes, kept across requests, found by content.

A prompt is prefilled in passes at offsets fixed by the prompt alone (the engine's chunks:
``prompt[i * chunk : (i + 1) * chunk]``, the last one ending before the prompt's last token).
What a pass writes into the cache depends only on its own tokens and every token before them,
so :class:`PrefixCache` keeps it keyed by exactly that: ``(the block of the pass before, this
pass's tokens)``. A later prompt that starts with the same passes reads them back (a copy into
its cache row) instead of computing them, and its first computed pass starts where a fresh
prefill's would: its output is bit for bit the one prefilling gives, in every dtype.

Why passes, not vLLM's 16-token blocks or SGLang's token-level radix tree: the runner's kernels
(CPU and CUDA) read a row's positions as one contiguous buffer, and a pass that starts at another
offset rounds its keys and values differently (bfloat16 flips greedy argmaxes), so only a hit
that ends on a pass boundary of the new prompt is exact. See docs/algorithm.md.

Blocks live in the runner's cache (``cache.save_block(id, slot, start, end)``, ``load_block(id,
slot, start)``, ``drop_block(id)``: on every rank of a sharded target); this class is the index:
content -> block, least recently used eviction of blocks no other block extends, under a bound in
bytes. A request's row holds a copy, so a block is never shared by a running sequence: rollback
after a rejected draft touches only the row, and evicting a block never touches a running request.
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError

#: the prefix cache's memory bound when none is given
DEFAULT_MEMORY = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30}


def parse_memory(value, what: str = "prefix_cache_memory") -> int:
    """Bytes from an int or a size such as ``"512MiB"``, ``"2GB"``, ``"1g"`` (ConfigError naming ``what`` otherwise)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = found and found.group(2).lower()
    if not found or unit not in _UNITS:
        zero = " (0: no prefix caching)" if what == "prefix_cache_memory" else ""
        raise ConfigError(f"{what} must be a size in bytes such as 512MiB, 2GB or 1073741824{zero}, got {value!r}",
                          param=what)
    return int(float(found.group(1)) * _UNITS[unit])


def turn_ends(tokens: list[int], mark: tuple[int, ...]) -> list[int]:
    """The positions just after each occurrence of ``mark`` in ``tokens``, in order (none for an empty mark)."""
    if not mark:
        return []
    n, first = len(mark), mark[0]
    return [i + n for i, t in enumerate(tokens) if t == first and tuple(tokens[i : i + n]) == mark]


def turn_mark(tokenizer) -> tuple[int, ...]:
    """The token ids of ``tokenizer``'s chat template's generation prompt but its last token
    (ChatML: ``<|im_start|>assistant``), where a chat prompt's prefill ends; empty when there is
    no template, or its generation prompt is not tokens appended to the conversation's."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return ()
    chat = [{"role": "user", "content": "Hi"}]
    try:
        bare = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        asked = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        if not (isinstance(bare, str) and isinstance(asked, str) and asked.startswith(bare)):
            return ()
        short = tokenizer(bare, add_special_tokens=False).input_ids
        long = tokenizer(asked, add_special_tokens=False).input_ids
    except Exception:  # noqa: BLE001 - a template that cannot render this: no mark, passes at fixed offsets only
        return ()
    if long[: len(short)] != short or len(long) - len(short) < 2:
        return ()
    return tuple(long[len(short) : -1])


@dataclass(eq=False)
class Block:
    """One prefill pass's keys and values, stored in the runner's cache under ``id``."""

    id: int
    key: tuple  # (the previous block's id or -1, this pass's tokens)
    parent: "Block | None"
    tokens: int
    nbytes: int
    #: the target's hidden states of the pass's positions, for a drafter that asks for them
    hidden: torch.Tensor | None = None
    children: int = 0


@dataclass
class PrefixStats:
    """Blocks the cache has stored and evicted since it was made (the requests' hits are their
    own ``stats.cached_tokens``, which the server's metrics count)."""

    stored_blocks: int = 0
    evicted_blocks: int = 0


@dataclass(eq=False)
class PrefixCache:
    """The index of a runner cache's saved blocks (see the module docstring): at most ``memory``
    bytes of blocks, whose size is ``token_bytes`` per token (plus their hidden states)."""

    store: object  # the runner's cache
    memory: int
    token_bytes: int
    blocks: "OrderedDict[tuple, Block]" = field(default_factory=OrderedDict)  # least recently used first
    used: int = 0
    stats: PrefixStats = field(default_factory=PrefixStats)
    _ids: itertools.count = field(default_factory=itertools.count)

    def _key(self, parent: Block | None, tokens) -> tuple:
        return (-1 if parent is None else parent.id, tuple(tokens))

    def alive(self, block: Block | None) -> bool:
        """Whether ``block`` (None: the empty prefix) is still stored."""
        return block is None or self.blocks.get(block.key) is block

    def find(self, parent: Block | None, tokens) -> Block | None:
        """The stored pass of ``tokens`` after ``parent`` (None: at the prompt's start), marked used."""
        if not self.alive(parent):
            return None
        block = self.blocks.get(self._key(parent, tokens))
        if block is not None:
            self.blocks.move_to_end(block.key)
        return block

    def load(self, block: Block, slot: int, start: int) -> None:
        """Copy ``block`` into row ``slot`` from position ``start`` (the row's length is the caller's)."""
        self.store.load_block(block.id, slot, start)

    def save(self, parent: Block | None, tokens, slot: int, start: int, hidden: torch.Tensor | None) -> Block | None:
        """Keep the pass of ``tokens`` that row ``slot`` holds from ``start``, after ``parent``;
        the stored block (an equal one already there, or None when it cannot be kept: ``parent``
        was evicted, or it does not fit even with every evictable block gone)."""
        if not self.alive(parent):
            return None
        key = self._key(parent, tokens)
        block = self.blocks.get(key)
        if block is not None:  # kept already (by a request with the same beginning)
            self.blocks.move_to_end(key)
            return block
        nbytes = len(key[1]) * self.token_bytes + (0 if hidden is None else hidden.numel() * hidden.element_size())
        while self.used + nbytes > self.memory:
            if not self._evict_one(keep=parent):
                return None
        block = Block(next(self._ids), key, parent, len(key[1]), nbytes,
                      None if hidden is None else hidden.detach().clone())
        self.store.save_block(block.id, slot, start, start + block.tokens)
        self.blocks[key] = block
        self.used += nbytes
        self.stats.stored_blocks += 1
        if parent is not None:
            parent.children += 1
        return block

    def _evict_one(self, keep: Block | None) -> bool:
        """Drop the least recently used block that no stored block extends (never ``keep``)."""
        for key, block in self.blocks.items():
            if block.children == 0 and block is not keep:
                del self.blocks[key]
                self.store.drop_block(block.id)
                self.used -= block.nbytes
                self.stats.evicted_blocks += 1
                if block.parent is not None:
                    block.parent.children -= 1
                return True
        return False


__all__ = ["DEFAULT_MEMORY", "Block", "PrefixCache", "PrefixStats", "parse_memory", "turn_ends", "turn_mark"]
