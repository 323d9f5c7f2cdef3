"""The transformers fallback's KV cache: preallocated, rolled back by writing lengths.

Row ``b`` stores position ``p`` at index ``p`` of every layer's buffers, ``stored[b]`` says how
many are valid, the attention mask hides everything past them, and rollback is assigning lengths:
the same interface as :class:`~specdraft.cache.static.StaticCache`, over buffers that
transformers' attention writes into (a ``transformers.cache_utils.Cache``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _Layer(CacheLayerMixin):
    """One layer's buffers; writes go where the owning :class:`HFCache` says."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "HFCache") -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, k_dim = key_states.shape
        shape = (batch, heads, self.owner.slots)
        self.keys = torch.zeros(*shape, k_dim, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(*shape, value_states.shape[-1], dtype=value_states.dtype, device=value_states.device)
        self.device = key_states.device
        self.is_initialized = True

    def grow(self, slots: int) -> None:
        """Reallocate to ``slots`` positions, keeping what is stored (rare: see :meth:`HFCache.reserve`)."""
        if self.is_initialized and self.keys.shape[2] < slots:
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = torch.zeros((*old.shape[:2], slots, old.shape[3]), dtype=old.dtype, device=old.device)
                new[:, :, : old.shape[2]] = old
                setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states / value_states  # [batch, kv_heads, n, head_dim]
        owner = self.owner
        if not self.is_initialized or self.keys.shape[0] != key_states.shape[0] or self.keys.shape[2] < owner.slots:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        if owner._uniform_start is not None:  # every row writes at the same offset: a slice copy
            start = owner._uniform_start
            self.keys[:, :, start : start + n].copy_(key_states)
            self.values[:, :, start : start + n].copy_(value_states)
        else:
            index = owner._write_index  # [batch, 1, n, 1]
            self.keys.scatter_(2, index.expand_as(key_states), key_states)
            self.values.scatter_(2, index.expand_as(value_states), value_states)
        end = owner._kv_len
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner._kv_len, 0

    def get_seq_length(self) -> int:
        return max(self.owner.stored, default=0)

    def get_max_length(self) -> int:
        return self.owner.slots


class HFCache(Cache):
    """Preallocated, rollback-by-length KV cache that transformers' attention writes into, with the
    interface of :mod:`specdraft.cache` (see the module docstring). ``stored[b]`` is row ``b``'s
    length on the host; ``slots`` the positions a row may hold."""

    def __init__(self, num_layers: int, slots: int = 0) -> None:
        self.slots = slots
        self.stored: list[int] = []
        self._uniform_start: int | None = 0
        self._write_index: torch.Tensor | None = None
        self._kv_len = 0
        self.device = torch.device("cpu")
        super().__init__(layers=[_Layer(self) for _ in range(num_layers)])

    # -- the interface of specdraft.cache ---------------------------------------------------

    def reset(self, rows: int, max_len: int) -> None:
        """Empty every row; buffers are kept when they still fit."""
        self.slots = max_len
        self.stored = [0] * rows

    def reserve(self, max_len: int, rows: int | None = None) -> None:
        """Room for ``max_len`` positions per row (and ``rows`` rows) without losing what is stored.

        For callers that cannot size the cache up front (a draft model does not know the
        request's budget); growth copies the buffers once, never per step.
        """
        if max_len > self.slots:
            self.slots = max(max_len, self.slots * 2)
            for layer in self.layers:
                layer.grow(self.slots)
        if rows is not None and rows > len(self.stored):
            extra = rows - len(self.stored)
            self.stored += [0] * extra
            for layer in self.layers:
                if layer.is_initialized:
                    for name in ("keys", "values"):
                        old = getattr(layer, name)
                        setattr(layer, name, torch.cat([old, old.new_zeros((extra, *old.shape[1:]))]))

    @property
    def lengths(self) -> torch.Tensor:
        """Each row's stored token count.  # [rows]"""
        return torch.tensor(self.stored, dtype=torch.long, device=self.device)

    def set_lengths(self, lengths, bound: int | None = None, slots=None) -> None:
        """Rollback: row ``b`` (or ``slots[b]``) keeps its first ``lengths[b]`` tokens."""
        values = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths))]
        if slots is None:
            self.stored = values
        else:
            for s, n in zip(slots, values):
                self.stored[int(s)] = n

    def keep_paths(self, paths) -> None:
        raise NotImplementedError("transformers' fallback verifies chains only (its runner's supports_tree is False)")

    @contextmanager
    def rows(self, slots: list[int] | None):
        """Within the block the cache holds only rows ``slots`` (a gathered copy, written back after),
        for a pass over a subset of the rows; None or every row in order: the cache itself."""
        if slots is None or slots == list(range(len(self.stored))):
            yield
            return
        everyone = self.stored
        index = torch.tensor(slots, device=self.device)
        full = {}
        for layer in self.layers:
            if layer.is_initialized:
                full[id(layer)] = (layer.keys, layer.values)
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.stored = [everyone[s] for s in slots]
        try:
            yield
        finally:
            for layer in self.layers:
                keys, values = full.get(id(layer), (None, None))
                if keys is None or keys.shape[2] < layer.keys.shape[2]:  # first pass, or the buffers grew
                    shape = (len(everyone), *layer.keys.shape[1:])
                    new_keys, new_values = layer.keys.new_zeros(shape), layer.values.new_zeros(shape)
                    if keys is not None:
                        new_keys[:, :, : keys.shape[2]], new_values[:, :, : keys.shape[2]] = keys, values
                    keys, values = new_keys, new_values
                keys[index], values[index] = layer.keys, layer.values
                layer.keys, layer.values = keys, values
            for s, n in zip(slots, self.stored):
                everyone[s] = n
            self.stored = everyone

    # -- what transformers' attention calls ---------------------------------------------------

    def prepare(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up a forward of ``n`` tokens per row; returns ``(position_ids, attention_mask)``.

        position_ids   # [batch, n]          row b's tokens sit at stored[b] .. stored[b]+n-1
        attention_mask # [batch, 1, n, kv]   additive: 0 where a query may look, min-float elsewhere
        """
        if max(self.stored) + n > self.slots:
            raise ValueError(f"KV cache overflow: {max(self.stored)} + {n} tokens > {self.slots} slots")
        starts = torch.tensor(self.stored, device=device)  # [batch]
        positions = starts[:, None] + torch.arange(n, device=device)  # [batch, n]
        self._kv_len = max(self.stored) + n
        first = self.stored[0]
        if all(length == first for length in self.stored):
            self._uniform_start, self._write_index = first, None
        else:
            self._uniform_start = None
            self._write_index = positions[:, None, :, None]
        visible = torch.arange(self._kv_len, device=device) <= positions[:, :, None]  # [batch, n, kv]
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return positions, mask[:, None]

    def advance(self, steps: list[int]) -> None:
        """After a pass: row ``b`` holds ``steps[b]`` more tokens."""
        self.stored = [b + n for b, n in zip(self.stored, steps)]
