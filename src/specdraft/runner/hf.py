"""transformers' own model, eager, for architectures specdraft's model code does not reproduce.

:class:`TransformersRunner` has the :class:`~specdraft.runner.runner.ModelRunner` interface over
transformers' module, with a preallocated cache that transformers' attention writes into
(:class:`HFCache`): row ``b`` stores position ``p`` at index ``p``, ``lengths[b]`` says how many are
valid, the attention mask hides everything past them, and rollback is assigning lengths.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .base import RunnerBase, attention_backends


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
        """Reallocate to ``slots`` slots, keeping what is stored (rare: see ``KVCache.reserve``)."""
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
        return max(self.owner.lengths, default=0)

    def get_max_length(self) -> int:
        return self.owner.slots


class HFCache(Cache):
    """Preallocated, rollback-by-length KV cache (see the module docstring)."""

    def __init__(self, num_layers: int, slots: int) -> None:
        self.slots = slots
        self.lengths: list[int] = []
        self._uniform_start: int | None = 0
        self._write_index: torch.Tensor | None = None
        self._kv_len = 0
        super().__init__(layers=[_Layer(self) for _ in range(num_layers)])

    def reset(self, batch_size: int, slots: int | None = None) -> None:
        """Empty every row; buffers are kept when batch size and slot count still fit."""
        if slots is not None:
            self.slots = slots
        self.lengths = [0] * batch_size

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` positions per row without losing what is stored.

        For callers that cannot size the cache up front (a draft model does not know the
        request's budget); growth copies the buffers once, never per step.
        """
        if slots > self.slots:
            self.slots = max(slots, self.slots * 2)
            for layer in self.layers:
                layer.grow(self.slots)

    def prepare(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up a forward of ``n`` tokens per row; returns ``(position_ids, attention_mask)``.

        position_ids   # [batch, n]          row b's tokens sit at lengths[b] .. lengths[b]+n-1
        attention_mask # [batch, 1, n, kv]   additive: 0 where a query may look, min-float elsewhere
        """
        if max(self.lengths) + n > self.slots:
            raise ValueError(f"KV cache overflow: {max(self.lengths)} + {n} tokens > {self.slots} slots")
        starts = torch.tensor(self.lengths, device=device)  # [batch]
        positions = starts[:, None] + torch.arange(n, device=device)  # [batch, n]
        self._kv_len = max(self.lengths) + n
        first = self.lengths[0]
        if all(length == first for length in self.lengths):
            self._uniform_start, self._write_index = first, None
        else:
            self._uniform_start = None
            self._write_index = positions[:, None, :, None]
        visible = torch.arange(self._kv_len, device=device) <= positions[:, :, None]  # [batch, n, kv]
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return positions, mask[:, None]


class TransformersRunner(RunnerBase):
    """transformers' model as a runner (eager, float or whatever it was loaded as)."""

    implementation = "transformers"
    compile_seconds = 0.0

    def __init__(self, hf_model, reason: str = "") -> None:
        self.model = hf_model
        self.fallback_reason = reason  # why specdraft's own model code does not run it
        self.cache = HFCache(hf_model.config.get_text_config().num_hidden_layers, slots=0)

    def reset(self, rows: int, max_len: int) -> None:
        self.cache.reset(rows, slots=max_len)

    def warm_up(self, rows: int, widths) -> None:
        """Nothing to compile."""

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor(self.cache.lengths, dtype=torch.long, device=self.device)

    def set_lengths(self, lengths, bound: int | None = None, slots=None) -> None:
        values = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths))]
        if slots is None:
            self.cache.lengths = values
        else:
            for s, n in zip(slots, values):
                self.cache.lengths[int(s)] = n

    def reserve(self, max_len: int, rows: int | None = None) -> None:
        self.cache.reserve(max_len)
        if rows is not None and rows > len(self.cache.lengths):
            extra = rows - len(self.cache.lengths)
            self.cache.lengths += [0] * extra
            for layer in self.cache.layers:
                if layer.is_initialized:
                    for name in ("keys", "values"):
                        old = getattr(layer, name)
                        setattr(layer, name, torch.cat([old, old.new_zeros((extra, *old.shape[1:]))]))

    def forward(self, tokens: torch.Tensor, logits_at: torch.Tensor | None = None, hidden: bool = False,
                advance=None, slots=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        slots = None if slots is None else [int(s) for s in slots]
        if slots is None or slots == list(range(len(self.cache.lengths))):
            return self._forward(tokens, logits_at, hidden, advance)
        # a subset of the rows: run on a gathered copy of their buffers, then write it back
        everyone = self.cache.lengths
        index = torch.tensor(slots, device=tokens.device)
        full = {}
        for layer in self.cache.layers:
            if layer.is_initialized:
                full[id(layer)] = (layer.keys, layer.values)
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.cache.lengths = [everyone[s] for s in slots]
        try:
            return self._forward(tokens, logits_at, hidden, advance)
        finally:
            for layer in self.cache.layers:
                keys, values = full.get(id(layer), (None, None))
                if keys is None or keys.shape[2] < layer.keys.shape[2]:  # first pass, or the buffers grew
                    shape = (len(everyone), *layer.keys.shape[1:])
                    new_keys, new_values = layer.keys.new_zeros(shape), layer.values.new_zeros(shape)
                    if keys is not None:
                        new_keys[:, :, : keys.shape[2]], new_values[:, :, : keys.shape[2]] = keys, values
                    keys, values = new_keys, new_values
                keys[index], values[index] = layer.keys, layer.values
                layer.keys, layer.values = keys, values
            for s, n in zip(slots, self.cache.lengths):
                everyone[s] = n
            self.cache.lengths = everyone

    def _forward(self, tokens, logits_at, hidden, advance):
        before = list(self.cache.lengths)
        width = tokens.shape[1]
        position_ids, mask = self.cache.prepare(width, tokens.device, self.model.dtype)
        keep = 0
        if logits_at is not None:  # only the last positions asked for need the LM head
            keep = width - int(logits_at.min())
        with attention_backends(tokens.device):
            out = self.model(input_ids=tokens, position_ids=position_ids, attention_mask=mask,
                             past_key_values=self.cache, use_cache=True, logits_to_keep=keep,
                             output_hidden_states=hidden)
        logits = out.logits  # [rows, keep or W, vocab]
        if logits_at is not None:
            index = logits_at - (width - logits.shape[1])  # [rows, N]
            logits = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
        steps = [width] * len(before) if advance is None else list(torch.as_tensor(advance).tolist())
        self.cache.lengths = [b + n for b, n in zip(before, steps)]
        return logits, out.hidden_states[-1] if hidden else None
