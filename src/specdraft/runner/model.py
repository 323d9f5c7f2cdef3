"""Llama-family decoder owned by specdraft, in the style of gpt-fast's ``model.py``.

One set of modules serves Llama (SmolLM2, Llama 3.x), Mistral, Qwen2 and Qwen3: fused q/k/v
(``wqkv``) and gate/up (``w13``) projections, RMSNorm, rotary embeddings (default or Llama-3
scaled), grouped KV heads, optional q/k/v bias (Qwen2) and per-head q/k norms (Qwen3), tied or
untied embeddings, an optional sliding window (Mistral).

The forward is explicit: tokens and a :class:`~specdraft.cache.KVCache` in, logits (and
the final hidden states when asked) out. Positions, write indices and the attention mask come
from the cache's device-side lengths, so nothing in the forward is a Python int that changes
from step to step. Weights come from a loaded transformers model (:mod:`.convert`).

The arithmetic follows transformers' modules operation by operation (RMSNorm in float32, rotary
tables computed in float32 then cast), so logits agree with transformers' to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..cache.static import KVCache, attention_mask, pass_positions, write_kv
from . import cpu_ops
from .kernels import decode_attention, decode_attention_applies, tree_attention, tree_order


@dataclass(frozen=True)
class ModelArgs:
    """What the modules need to know, read from a transformers config by :mod:`.convert`."""

    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # may differ from dim // n_heads (Qwen3)
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_llama3: tuple[float, float, float, int] | None = None  # (factor, low, high, original_max_positions)
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before the rotation
    tie_embeddings: bool = False
    sliding_window: int | None = None  # Mistral: a query sees this many positions, itself included


class LeanOps(NamedTuple):
    """A decoder layer's fused operators, set on its modules (``lean``) when a model is loaded: the
    C++ ones on CPU (:mod:`.cpu_ops`), Triton ones on CUDA (:mod:`.cuda_kernels`). Each computes a
    row the same way whatever else its call holds (row-invariant by construction).

    ``rms_norm(x, weight, eps)``; ``add_rms_norm(x, y, weight, eps) -> (x + y, rms_norm(x + y))``;
    ``rope_write(qkv, cos, sin, k_buf, v_buf, slot, positions, heads, kv_heads) -> q # [B, heads, W, D]``
    (keys rotated and values written into the cache); ``attention(q, k_buf, v_buf, slot, mask,
    scale, order) -> [B, W, heads * D]`` over the cache in place, for passes of up to ``width``
    tokens (wider ones use SDPA); ``silu_mul(g) -> silu(gate) * up``."""

    rms_norm: object
    add_rms_norm: object
    rope_write: object
    attention: object
    silu_mul: object
    width: int


def use_lean(model: nn.Module, lean: LeanOps) -> None:
    """Give every module of ``model`` that has a ``lean`` slot (attention, feed-forward, blocks) ``lean``."""
    for module in model.modules():
        if hasattr(module, "lean"):
            module.lean = lean


class ForwardOutput(NamedTuple):
    logits: torch.Tensor  # [B, W, vocab], or [B, N, vocab] at ``logits_at``; the model's dtype
    hidden: torch.Tensor | None  # [B, W, dim] after the final norm, or [B, W, n * dim] at n chosen layers


def hidden_layers(hidden, n_layers: int) -> tuple[int, ...]:
    """The layers a ``hidden`` request names: ``()`` for False / True (none, or the final-norm
    states), else the tuple of layer ids, each in ``0..n_layers - 1`` (ValueError otherwise)."""
    if isinstance(hidden, bool) or hidden is None:
        return ()
    layers = tuple(int(i) for i in hidden)
    if not layers or any(not 0 <= i < n_layers for i in layers):
        raise ValueError(f"hidden layers {list(layers)} are not all among the model's layers 0..{n_layers - 1}")
    return layers


def pick_layers(collected: list[torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor:
    """``collected`` (the inputs of ``sorted(set(layers))``' blocks, in block order) in the order
    ``layers`` names them, concatenated on the last dimension.  # [B, W, len(layers) * dim]"""
    order = sorted(set(layers))
    return torch.cat([collected[order.index(i)] for i in layers], dim=-1)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, float32, as transformers' ``modeling_rope_utils``
    computes them (default, or ``rope_type="llama3"``).  # [head_dim // 2]"""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if args.rope_llama3 is None:
        return inv_freq
    factor, low_freq_factor, high_freq_factor, old_context_len = args.rope_llama3
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the ones between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at ``positions # [B, W]``, computed in float32 and cast.  # [B, 1, W, head_dim] each"""
    freqs = positions[..., None].float() * inv_freq.float()  # [B, W, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


#: inv_freq -> its cos and sin tables side by side, ``[2, L, head_dim]`` (:func:`rope_lookup`), dropped
#: with the tensor
_ROPE_TABLES = WeakIdKeyDictionary()


def rope_lookup(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_tables` at ``positions # [B, W]`` (each below ``length``), read from tables of every
    position below ``length`` made once by :func:`rope_tables` per ``inv_freq`` and dtype: two index
    operations a pass where computing them takes nine (a fifth of a drafter's one-layer step's glue
    on CPU). The same values: each entry is the same float32 product, cosine and cast wherever it
    sits in a tensor (a test holds the two to the same bits).  # [B, 1, W, head_dim] each

    A table is made again only when ``length`` (a cache's) grows, which reallocates the cache and
    so makes its runner capture its CUDA graphs again (their warm-up makes the table first)."""
    cos, sin = rope_table(inv_freq, dtype, length, positions.device)[:, positions][:, :, None]  # [2, B, 1, W, head_dim]
    return cos, sin


def rope_table(inv_freq: torch.Tensor, dtype: torch.dtype, length: int, device) -> torch.Tensor:
    """:func:`rope_lookup`'s cos and sin tables side by side for every position below ``length`` (at
    least), made once per ``inv_freq``, dtype and device.  # [2, T, head_dim], T >= length"""
    table = _ROPE_TABLES.get(inv_freq)
    if table is None or table.shape[1] < length or table.dtype != dtype or table.device != device:
        cos, sin = rope_tables(inv_freq, torch.arange(length, device=device)[None], dtype)
        table = _ROPE_TABLES[inv_freq] = torch.stack([cos[0, 0], sin[0, 0]])  # [2, length, head_dim]
    return table


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    """transformers' RMSNorm: normalised in float32, cast back, then scaled by the weight.

    ``kernel``: ``kernel(x, weight, eps)`` computes it instead (on CUDA, a row-invariant Triton
    kernel set when the model is loaded: :func:`~specdraft.runner.cuda_kernels.make_invariant`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.kernel or rms_norm)(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm in torch ops: normalised in float32, cast back, times the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        #: on CUDA, the row-invariant attention of decode-width passes, set when the model is loaded
        #: (:func:`~specdraft.runner.cuda_kernels.make_invariant`): ``(q, keys, values, mask, scale, order)``
        self.decode_kernel = None
        #: the layer's fused operators (a :class:`LeanOps`, set when the model is loaded), or None
        self.lean = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                k_buf: torch.Tensor, v_buf: torch.Tensor, slot: torch.Tensor, positions: torch.Tensor,
                gather: bool, order: torch.Tensor | None = None) -> torch.Tensor:
        batch, width, _ = x.shape  # x: [B, W, dim]
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        scale = self.head_dim**-0.5
        if self.lean is not None:  # rotation and cache write in one operator, decode attention in another
            q = self.lean.rope_write(self.wqkv(x), cos, sin, k_buf, v_buf, slot, positions, self.n_heads,
                                     self.n_kv_heads)  # [B, heads, W, head_dim]
            if width <= self.lean.width:  # a verify pass equals its one-token steps
                return self.wo(self.lean.attention(q, k_buf, v_buf, slot, mask, scale, order))
            return self.wo(self._sdpa(q, *((k_buf[slot], v_buf[slot]) if gather else (k_buf, v_buf)), mask))
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, width, self.n_heads, self.head_dim)
        k = k.view(batch, width, self.n_kv_heads, self.head_dim)
        v = v.view(batch, width, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, W, head_dim]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = write_kv(k_buf, v_buf, slot, positions, k, v, gather)  # [B, kv_heads, max_len, head_dim]
        if width <= CUDA_DECODE_WIDTH and self.decode_kernel is not None:  # CUDA: tokens as in one-token steps
            y = self.decode_kernel(q, keys, values, mask, scale, order)
        elif width <= DECODE_WIDTH and decode_attention_applies(q):  # a verify pass equals its one-token steps
            if order is None:
                y = decode_attention(q, keys, values, mask, scale)
            else:  # a tree: each token against its own ancestors, laid out as in one-token steps
                y = tree_attention(q, keys, values, mask, order, scale)
        else:
            return self.wo(self._sdpa(q, keys, values, mask))
        return self.wo(y.transpose(1, 2).reshape(batch, width, q_size))

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of a wide pass (prefill) through SDPA, in the output projection's layout.  # [B, W, heads * D]"""
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.head_dim**-0.5,
                                           enable_gqa=self.n_heads != self.n_kv_heads)  # [B, heads, W, head_dim]
        return y.transpose(1, 2).reshape(q.shape[0], q.shape[2], self.n_heads * self.head_dim)


#: Passes up to this wide use :func:`~specdraft.runner.kernels.decode_attention` on CPU and the
#: kernels of :mod:`~specdraft.runner.cuda_kernels` on CUDA (prefill does not: plain and
#: speculative decoding share it, so its rounding cannot make them differ).
DECODE_WIDTH = 32
#: ... and up to this wide on CUDA, where the invariant kernels cost little more at 64 tokens than at 32
CUDA_DECODE_WIDTH = 64


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)
        self.lean = None  # a :class:`LeanOps` (set when the model is loaded), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lean is not None:
            return self.w2(self.lean.silu_mul(self.w13(x)))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)
        self.lean = None  # a :class:`LeanOps` (set when the model is loaded), or None
        #: the whole layer in one operator for passes of up to ``lean.width`` tokens (set when the
        #: model is loaded, :func:`~.cpu_ops.use`): ``(x, cos, sin, mask, k_buf, v_buf, slot, positions,
        #: order)``, the same operators as below in one call; or None
        self.fused = None

    def forward(self, x, cos, sin, mask, k_buf, v_buf, slot, positions, gather: bool, order=None) -> torch.Tensor:
        if self.fused is not None and x.shape[1] <= self.lean.width:
            return self.fused(x, cos, sin, mask, k_buf, v_buf, slot, positions, order)
        if self.lean is not None:  # the residual add and the second norm in one operator
            attended = self.attention(self.attention_norm(x), cos, sin, mask, k_buf, v_buf, slot, positions, gather,
                                      order)
            h, normed = self.lean.add_rms_norm(x, attended, self.ffn_norm.weight, self.ffn_norm.eps)
            return h + self.feed_forward(normed)
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, k_buf, v_buf, slot, positions, gather, order)
        return h + self.feed_forward(self.ffn_norm(h))


def run_block(block: nn.Module, *args) -> torch.Tensor:
    """One decoder block, eagerly; a compiled runner passes a compiled version of this very function."""
    return block(*args)


def run_blocks(blocks, x: torch.Tensor, cache: KVCache, rows: torch.Tensor | None, inv_freq: torch.Tensor,
               window: int | None = None, tree_mask: torch.Tensor | None = None, block_fn=run_block,
               span: int | None = None, depths: torch.Tensor | None = None,
               collect: tuple[int, ...] = (), collected: list | None = None, layers_fn=None) -> torch.Tensor:
    """``x # [B, W, dim]`` through ``blocks`` (layer ``i`` on the cache's buffers ``i``); the cache's
    lengths are left as they were (the caller advances them).  # [B, W, dim]

    Positions, the mask and the rotary tables are computed once here from the cache's lengths, on
    the device; ``block_fn(block, x, ...)`` runs each block (one compiled graph serves them all).
    ``span``: attend over (and write within) the first ``span`` positions of the buffers only, which
    the caller guarantees hold every row's tokens and this pass's (default: all ``max_len``).
    ``tree_mask`` (see :func:`~specdraft.cache.static.attention_mask`) and ``depths # [B, W]``: a
    tree's tokens are stored at ``starts + 0..W-1`` but rotated as at position ``starts + depths``.
    ``collect``: append the input of each of these blocks (the residual stream there, what
    transformers' ``output_hidden_states[i]`` is) to ``collected``, in block order. ``layers_fn``:
    every block in one call instead, ``layers_fn(x, cos, sin, mask, keys, values, span, slot,
    positions, order, collect) -> (x, collected)`` with the cache's whole buffers
    (:func:`~.cpu_ops.fused_layers`).
    """
    batch, width = x.shape[:2]
    span = cache.max_len if span is None else span
    starts = cache.starts(rows)  # [B]
    # every position a pass writes (or rotates a tree's token to) is below the cache's length
    if tree_mask is None and depths is None and x.device.type == "cpu" and cpu_ops.PASS_TABLES is not None:
        table = rope_table(inv_freq, x.dtype, cache.max_len, x.device)  # what the branch below computes, in one call
        positions, mask, cos, sin = cpu_ops.PASS_TABLES(starts, width, span, table, window)
    else:
        positions = pass_positions(starts, width)  # [B, W]
        mask = attention_mask(starts, width, span, tree_mask, window, depths, positions)  # [B, 1, W, span]
        rotated = positions if depths is None else starts[:, None] + depths  # [B, W]
        cos, sin = rope_lookup(inv_freq, rotated, x.dtype, cache.max_len)  # [B, 1, W, head_dim]
    order = tree_order(mask) if tree_mask is not None and width <= CUDA_DECODE_WIDTH else None  # [B, W, span]
    slot = torch.arange(cache.slots, device=x.device) if rows is None else rows  # [B]
    if layers_fn is not None:
        x, inputs = layers_fn(x, cos, sin, mask, cache.keys, cache.values, span, slot, positions, order, collect)
        if collect:
            collected.extend(inputs)
        return x
    for i, block in enumerate(blocks):
        if i in collect:
            collected.append(x)
        keys, values = cache.keys[i][:, :, :span], cache.values[i][:, :, :span]  # views: writes land in the cache
        x = block_fn(block, x, cos, sin, mask, keys, values, slot, positions, rows is not None, order)
    return x


class SpecdraftModel(nn.Module):
    """A causal LM over a :class:`KVCache`. Build one with :func:`specdraft.runner.from_transformers`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        #: every layer in one operator for eager passes of up to ``lean.width`` tokens (set when the
        #: model is loaded, :func:`~.cpu_ops.use`; see :func:`run_blocks`), or None
        self.fused_layers = None
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # float32 whatever the model's dtype; not in the state dict (recomputed from args)
        self.register_buffer("rope_inv_freq", rope_inv_freq(args), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def to_dtype(self, dtype: torch.dtype) -> "SpecdraftModel":
        """Cast the weights to ``dtype`` in place (new tensors: a source model sharing them is left
        alone); the rotary frequencies stay float32."""
        inv_freq = self.rope_inv_freq
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.is_floating_point():
                    module._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope_inv_freq = inv_freq
        return self

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        """An empty cache for ``slots`` sequences of up to ``max_len`` tokens, on the model's device and dtype."""
        a = self.args
        return KVCache(a.n_layers, slots, a.n_kv_heads, max_len, a.head_dim, self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache, rows: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, return_hidden: bool = False,
                advance: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                span: int | None = None, depths: torch.Tensor | None = None, block_fn=None) -> ForwardOutput:
        """One pass of ``W`` new tokens per row over the cache.

        ``tokens # [B, W]`` long. ``rows # [B]`` long: the cache slots the batch rows use, distinct
        (None: every slot in order, ``B == cache.slots``, and the buffers are read without a gather).
        Row ``b`` writes its keys and values at positions ``lengths[rows[b]] + 0..W-1`` and then
        its length advances by ``W``, or by ``advance[b]`` (``advance # [B]`` long), e.g. a prompt
        shorter than the padded width. Rollback afterwards is ``cache.set_lengths(...)``.

        ``logits_at # [B, N]`` long: indices into ``0..W-1``; logits only there (``[B, N, vocab]``)
        instead of everywhere (``[B, W, vocab]``). ``return_hidden``: also return the hidden
        states after the final norm, ``[B, W, dim]``, at every position; or, given layer ids
        ``(i, j, ...)``, the residual stream entering each of those blocks (transformers'
        ``output_hidden_states[i]``), concatenated: ``[B, W, n * dim]``, from this same pass. ``tree_mask # [B, W, P]``
        bool: which tokens of the pass (and of the ``P - W`` positions before it) each token sees
        (default causal); ``depths # [B, W]``: the tokens' positions are ``lengths + depths``
        (default ``lengths + 0..W-1``); they are stored at ``lengths + 0..W-1`` either way.
        ``span``, ``block_fn`` (what runs each block; default :func:`run_block`): see :func:`run_blocks`.
        """
        layers = hidden_layers(return_hidden, self.args.n_layers)
        collected: list[torch.Tensor] = []
        x = self.tok_embeddings(tokens)  # [B, W, dim]
        whole = self.fused_layers if self.fused_layers is not None and block_fn in (None, run_block) \
            and tokens.shape[1] <= self.layers[0].lean.width else None
        x = run_blocks(self.layers, x, cache, rows, self.rope_inv_freq, self.args.sliding_window, tree_mask,
                       block_fn or run_block, span, depths, collect=layers, collected=collected, layers_fn=whole)
        hidden = self.norm(x)  # [B, W, dim]
        cache.advance(rows, tokens.shape[1] if advance is None else advance)
        if logits_at is not None:
            hidden_at = hidden.gather(1, logits_at[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, N, dim]
        else:
            hidden_at = hidden
        states = pick_layers(collected, layers) if layers else hidden if return_hidden else None
        return ForwardOutput(self.output(hidden_at), states)
