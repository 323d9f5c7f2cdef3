"""A preallocated KV cache with per-row lengths and O(1) rollback, usable by HF models.

Layout per layer: ``keys``/``values`` of shape ``[batch, kv_heads, slots, head_dim]``,
allocated once. Row ``b`` stores position ``p`` in slot ``p``; ``lengths[b]`` says how
many slots are valid. A forward writes its ``n`` new tokens at slots
``lengths[b] .. lengths[b] + n - 1`` of each row and the attention mask lets a query at
position ``p`` see slots ``<= p`` only, so whatever lies beyond a row's length (rejected
drafts, padding) is never read. Rolling back is assigning a smaller length: nothing is
copied, and the next write overwrites the stale slots.

Usage::

    cache = KVCache(num_layers=config.num_hidden_layers, slots=max_len + k + 1)
    cache.reset(batch_size)
    logits = forward_step(model, cache, input_ids)   # advances every row by n
    cache.rollback([kept_0, kept_1, ...])            # back to the accepted lengths
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..fastpath import few_row_linears


class _Layer(CacheLayerMixin):
    """One layer's buffers; writes go where the owning :class:`KVCache` says."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "KVCache") -> None:
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


class KVCache(Cache):
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

    def rollback(self, lengths: Sequence[int]) -> None:
        """Keep only the first ``lengths[b]`` positions of each row: O(1), no copy."""
        if len(lengths) != len(self.lengths):
            raise ValueError(f"rollback got {len(lengths)} lengths for a batch of {len(self.lengths)}")
        for b, (new, old) in enumerate(zip(lengths, self.lengths)):
            if not 0 <= new <= old:
                raise ValueError(f"row {b}: cannot roll back from length {old} to {new}")
        self.lengths = list(lengths)

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

    def advance(self, n: int) -> None:
        """Count the ``n`` tokens just written as valid (roll back what was not accepted)."""
        self.lengths = [length + n for length in self.lengths]


#: Attention kernels for specdraft's passes on a GPU. PyTorch prefers cuDNN's attention on
#: Hopper, which builds an execution plan for every new key length: about 1 ms of CPU per layer
#: per pass when a cache grows by a token or a few each step (measured on an H100 with a
#: Llama-3.2-3B-shaped model: 375 ms of 946 ms CPU in cuDNN's attention over 12 rounds, and a
#: 5-token verify pass at 83 ms against 18 ms for a fixed-length step). Decoding never repeats
#: a key length, so these passes use the flash / memory-efficient kernels instead.
GPU_ATTENTION = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def attention_backends(device: torch.device):
    """A context choosing :data:`GPU_ATTENTION` on CUDA (nothing changes on other devices)."""
    return sdpa_kernel(list(GPU_ATTENTION)) if device.type == "cuda" else nullcontext()


#: The attention specdraft's own passes use on CPU (registered with transformers below).
CPU_ATTENTION = "specdraft_cpu_gqa"


def _cpu_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """transformers' "sdpa" attention, with grouped key/value heads left grouped.

    With a mask and more than one query, transformers copies each layer's keys and values
    once per query head of a group before calling SDPA (``repeat_kv``): for SmolLM2 (9
    query heads, 3 key/value heads) at 769 tokens of context that is 3.5 MB written per layer,
    and a 2-token verify pass cost 1.19 one-token passes instead of 1.03. PyTorch's CPU
    attention takes the groups as they are (``enable_gqa``) and computes the same values.
    """
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])  # [batch, heads, n, dim]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(CPU_ATTENTION, _cpu_gqa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(CPU_ATTENTION, sdpa_mask)


@contextmanager
def _attention_for(model, device: torch.device):
    """Run ``model``'s "sdpa" attention as :func:`_cpu_gqa_attention` on CPU for the block."""
    config = model.config.get_text_config()
    if device.type != "cpu" or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = CPU_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def forward_step(model, cache: KVCache, input_ids: torch.Tensor, logits_to_keep: int = 0,
                 return_hidden: bool = False):
    """Run ``model`` over ``input_ids`` ``# [batch, n]`` appended to ``cache``.

    Returns logits ``# [batch, n, vocab]`` (the last ``logits_to_keep`` positions when > 0);
    every row's length grows by ``n``. With ``return_hidden``, returns ``(logits, hidden)``,
    ``hidden # [batch, n, hidden_size]`` being the decoder's output (after the final norm)
    at every position, taken by a hook so that the model's own forward runs unchanged.
    """
    n = input_ids.shape[1]
    position_ids, mask = cache.prepare(n, input_ids.device, model.dtype)
    captured: list[torch.Tensor] = []
    hook = None
    if return_hidden:
        def keep(module, args, output):
            captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

        hook = model.get_decoder().register_forward_hook(keep)
    try:
        with (few_row_linears(model, enabled=input_ids.device.type == "cpu"), attention_backends(input_ids.device),
              _attention_for(model, input_ids.device)):
            logits = model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep,
            ).logits
    finally:
        if hook is not None:
            hook.remove()
    cache.advance(n)
    return (logits, captured[-1]) if return_hidden else logits
