"""Decode kernels on CPU whose rows do not depend on how many rows a pass has.

Speculative decoding is exact only if a verify pass of ``W`` tokens gives each token, bit for
bit, the logits ``W`` one-token steps would give it: a bfloat16 model rounds coarsely enough that
any other rounding flips greedy argmaxes (9 of 13 Spec-Bench outputs differed from plain
decoding before these kernels). And it pays only if that pass costs about one step. torch's
default CPU kernels give neither: the product's kernel, and so its summation order, is chosen by
the row count, and float32 products of 2-5 rows cost up to 30x a one-row product on an AMD EPYC.

The rules, fixed (never chosen by timing), from measurements on a 2-core AMD EPYC (AVX-512 with
``avx512_bf16``), torch 2.13 CPU; ``benchmarks/row_invariance.py`` reprints them on any machine:

* **Linear layers and the output head** (float32 and bfloat16 on CPU): oneDNN with the weight
  prepacked once (:class:`PackedLinear`). For every shape of SmolLM2-135M and of larger models
  (up to 2048 x 8192), every row count from 2 to 48 gave rows bit-identical to a 2-row product
  in both dtypes, while one row takes another kernel once the inner dimension is 1152 or more;
  so a single row runs as two (the row twice). It is also the fastest kernel measured there:
  bfloat16, the 3072 x 576 product 0.04 ms at 1 row and 0.08 at 16 (MKL's ``F.linear``
  0.12 / 0.19), the 49152 x 576 head 0.6 / 1.6 ms (2.4 / 3.9). Because kernels differ between
  processors, each shape is also *checked* when a model is packed (:func:`checked_row_counts`: random
  rows, every row count to 64 and a few to 256, bit-identity — a check of results, not a
  timing): a pass runs as products of checked counts only, so a count that fails on some
  processor is never used there (one row at a time at worst), and :func:`pack_linears` reports it.
* **Attention of decode-width passes** (:func:`decode_attention`): bfloat16 and float16, each KV
  head's query rows (``G`` heads x ``W`` tokens) against its keys as one batched product with the
  softmax in float32 (oneDNN's batched product is row-invariant at every row count from 2, and a
  pass always has ``G >= 2`` rows or duplicates its one row); float32, elementwise products and
  reductions over one axis (MKL's float32 products are not row-invariant at any row count), in
  chunks of query rows so the intermediate stays small. Both gave the same bits for 1..16 query
  tokens and for spans of 64..2048 positions with the tail masked. float64 uses SDPA.
* **Quantized layers** (int8/int4, :mod:`.quantize`) compute each row alone already.

CUDA has its own rules and Triton kernels: :mod:`.cuda_kernels`. Not covered: float64 (the
parity tests' dtype: its rounding is too fine to flip a greedy argmax).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

#: row counts every packed shape is checked at when a model is packed (a pass's rows: batch x width; the
#: engine's widest verify pass is 8 rows x 32 tree tokens by default); a pass of other counts runs as
#: products of these, largest first
CHECKED_ROWS = (1, *range(2, 65), 96, 128, 192, 256)
#: the row count oneDNN's weight layout is prepared for (the layout, not a limit)
PACK_HINT = 16
#: float dtypes :class:`PackedLinear` serves on CPU
PACKED_DTYPES = (torch.float32, torch.bfloat16)

_CHECKED_COUNTS: dict[tuple, tuple[int, ...]] = {}  # (out, in, dtype, bias, threads) -> row counts that passed


def packable(linear: nn.Module) -> bool:
    """Whether ``linear`` is a plain CPU ``nn.Linear`` that :class:`PackedLinear` can replace."""
    if type(linear) is not nn.Linear or linear.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    dtype = linear.weight.dtype
    return dtype in PACKED_DTYPES and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """``nn.Linear`` over oneDNN with the weight prepacked once; rows independent of the row count.

    The packed weight is an opaque oneDNN tensor (``packed``, a plain attribute: it has no storage
    to save, copy or trace); ``bias # [out]`` (or None) is a buffer. ``counts``: the row counts
    one product may take (:func:`checked_row_counts`; :data:`CHECKED_ROWS` until checked); a pass of any
    other count runs as products of those, largest first, and a single row runs as two (see the
    module's docstring). Under ``torch.compile`` the product is one opaque operator,
    ``specdraft::packed_linear``, found through the ``handle`` buffer.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.nbytes = weight.numel() * weight.element_size()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.counts = CHECKED_ROWS
        handle = next(_HANDLES)
        _PACKED[handle] = self
        self.register_buffer("handle", torch.tensor(handle), persistent=False)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """One oneDNN product of ``flat # [rows, in]`` (at least 2 rows).  # [rows, out]"""
        return torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")

    def apply(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat # [rows, in]`` -> ``[rows, out]``, by the row rule (one row as two; products of checked counts)."""
        rows = flat.shape[0]
        if rows == 1:  # the one-row kernel sums in another order: run the row twice
            return self.product(torch.cat([flat, flat]))[:1]
        if rows in self.counts:
            return self.product(flat.contiguous())
        parts, start = [], 0
        while start < rows:
            n = max(c for c in self.counts if c <= rows - start)
            parts.append(self.apply(flat[start:start + n]))
            start += n
        return torch.cat(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [rows, in]
        if torch.compiler.is_compiling():
            out = torch.ops.specdraft.packed_linear(flat, self.handle, self.out_features)
        else:
            out = self.apply(flat)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"dtype={self.dtype}, checked to {self.counts[-1]} rows"


_PACKED: "weakref.WeakValueDictionary[int, PackedLinear]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


@torch.library.custom_op("specdraft::packed_linear", mutates_args=())
def _packed_linear(flat: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    """:meth:`PackedLinear.apply` of the module ``handle`` names, as one operator for compiled graphs."""
    return _PACKED[int(handle)].apply(flat)


@_packed_linear.register_fake
def _(flat: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return flat.new_empty(flat.shape[0], out_features)


def checked_row_counts(module: PackedLinear) -> tuple[int, ...]:
    """The row counts ``module``'s products are checked to take with every row bit-identical to a
    2-row product of that row alone: :data:`CHECKED_ROWS` (every count to 64, then a few to 256)
    up to the first that fails, on random rows (a fixed seed: deterministic). Remembered per shape,
    dtype and thread count. ``(1,)`` means row by row."""
    key = (module.out_features, module.in_features, module.dtype, module.bias is not None, torch.get_num_threads())
    if key in _CHECKED_COUNTS:
        return _CHECKED_COUNTS[key]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(CHECKED_ROWS[-1], module.in_features, generator=generator).to(module.dtype)
    with torch.inference_mode():
        alone = torch.cat([module.product(x[i:i + 1].expand(2, -1).contiguous())[:1] for i in range(x.shape[0])])
        passed = (1,)
        for n in CHECKED_ROWS[1:]:
            if not torch.equal(module.product(x[:n]), alone[:n]):
                break
            passed += (n,)
    _CHECKED_COUNTS[key] = passed
    return passed


def replace_linears(model: nn.Module, convert, when=None) -> dict[str, nn.Module]:
    """Replace every ``nn.Linear`` inside ``model`` (type exactly ``nn.Linear``, and ``when(linear)``
    if given) by ``convert(linear)``, in place. A linear that appears twice in the tree is replaced
    by one shared module. Returns the new modules by (first) name."""
    if type(model) is nn.Linear:
        raise TypeError("this replaces the linears inside a module; convert a lone nn.Linear with from_linear")
    done: dict[int, tuple[str, nn.Module]] = {}
    for prefix, parent in list(model.named_modules(remove_duplicate=False)):
        for name, child in list(parent._modules.items()):  # named_children() skips a second name of one module
            # not subclasses (MultiheadAttention reads its out_proj.weight)
            if type(child) is nn.Linear and (when is None or when(child)):
                if id(child) not in done:
                    done[id(child)] = (f"{prefix}.{name}".lstrip("."), convert(child))
                setattr(parent, name, done[id(child)][1])
    return dict(done.values())


def pack_linears(model: nn.Module) -> dict[str, int]:
    """Replace every :func:`packable` ``nn.Linear`` of ``model`` by a :class:`PackedLinear` (in place,
    as :func:`replace_linears` does), each checked by :func:`checked_row_counts`.

    Returns ``{"packed": n}`` plus, for each module whose shape failed the check, its name and the
    largest row count that passed (nothing else: every count in :data:`CHECKED_ROWS` passed)."""
    def pack(linear):
        packed = PackedLinear(linear)
        packed.counts = checked_row_counts(packed)
        return packed

    replaced = replace_linears(model, pack, when=packable)
    report = {"packed": len(replaced)}
    report.update({name: m.counts[-1] for name, m in replaced.items() if m.counts != CHECKED_ROWS})
    return report


# -- attention --------------------------------------------------------------------------------

#: float32 attention's elementwise intermediate is kept under about this many elements per chunk
F32_CHUNK_ELEMENTS = 1 << 20


def decode_attention_applies(q: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` computes this pass's attention (CPU, float32/bfloat16/float16)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention whose every query row is bit-identical however many queries the pass has and
    however many masked positions follow the keys (see the module's docstring for the rule).

    ``q # [B, heads, W, D]``, ``keys``/``values # [B, kv_heads, L, D]``, ``mask # [B, 1, W, L]``
    bool (True: attend). Scores and softmax in float32. Under ``torch.compile`` it is one opaque
    operator (``specdraft::decode_attention``), so a compiled pass sums exactly as an eager one
    (inductor would generate its own reductions, whose order depends on the shapes).  # [B, heads, W, D]"""
    if torch.compiler.is_compiling():
        return torch.ops.specdraft.decode_attention(q, keys, values, mask, scale)
    return _decode_attention(q, keys, values, mask, scale)


@torch.library.custom_op("specdraft::decode_attention", mutates_args=())
def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    if q.dtype == torch.float32:
        width = q.shape[2]
        per_chunk = max(1, F32_CHUNK_ELEMENTS // (q.shape[1] * keys.shape[2] * q.shape[3]))
        if width <= per_chunk:
            return elementwise_attention(q, keys, values, mask, scale)
        return torch.cat([elementwise_attention(q[:, :, i:i + per_chunk], keys, values, mask[:, :, i:i + per_chunk],
                                                scale) for i in range(0, width, per_chunk)], dim=2)
    return grouped_attention(q, keys, values, mask, scale).contiguous()


@_decode_attention.register_fake
def _(q, keys, values, mask, scale):
    return q.new_empty(q.shape)  # contiguous, as every form returns it


def tree_order(mask: torch.Tensor) -> torch.Tensor:
    """For each token of a tree pass, the key positions it sees, in order, then the ones it does
    not: the layout its one-token step would have (the committed positions, its ancestors by
    depth, itself, then nothing). ``mask # [B, 1, W, L]`` bool; a tree stores each node after its
    ancestors.  # [B, W, L] long"""
    return torch.sort((~mask[:, 0]).to(torch.uint8), dim=-1, stable=True).indices


def tree_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   order: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`decode_attention` of a tree pass, each token as a one-token step: its keys and values
    gathered in :func:`tree_order` (so a sum over positions meets them in the order, and at the
    places, the one-token step would), every token a batch row of its own. The gathers cost
    ``W`` copies of the span's keys and values per layer: trees only.

    Shapes as for :func:`decode_attention`; ``order # [B, W, L]`` long.  # [B, heads, W, D]"""
    batch, heads, width, dim = q.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    index = order[:, None, :, :, None].expand(batch, kv_heads, width, span, dim)  # [B, kvH, W, L, D]

    def per_token(buf):  # [B, kvH, L, D] -> [B * W, kvH, L, D], token w's positions in order
        gathered = buf[:, :, None].expand(batch, kv_heads, width, span, dim).gather(3, index)
        return gathered.transpose(1, 2).reshape(batch * width, kv_heads, span, dim)

    seen = mask[:, 0].gather(-1, order).reshape(batch * width, 1, 1, span)  # [B * W, 1, 1, L]
    tokens = q.transpose(1, 2).reshape(batch * width, heads, 1, dim)  # [B * W, heads, 1, D]
    out = decode_attention(tokens, per_token(keys), per_token(values), seen, scale)  # [B * W, heads, 1, D]
    return out.reshape(batch, width, heads, dim).transpose(1, 2)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Each KV head's ``G x W`` query rows against its keys as batched products (bfloat16 or
    float16 on CPU: oneDNN), the softmax in float32. Scores are ``keys @ queries.T`` so the cache's
    keys are read in place (no transposed copy); a single query row of a single head is run twice
    so that no product has one row or column. Shapes as for :func:`decode_attention`.  # [B, heads, W, D]"""
    batch, heads, width, dim = q.shape
    kv_heads = keys.shape[1]
    rows = heads // kv_heads * width
    grouped = q.reshape(batch, kv_heads, rows, dim)  # [B, kvH, G*W, D]
    if rows == 1:
        grouped = torch.cat([grouped, grouped], dim=2)
    scores = torch.matmul(keys, grouped.transpose(-1, -2))[..., :rows]  # [B, kvH, L, G*W]
    scores = scores.transpose(-1, -2).float().reshape(batch, kv_heads, heads // kv_heads, width, -1) * scale
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # [B, kvH, G, W, L]
    probs = scores.softmax(-1).to(values.dtype).reshape(batch, kv_heads, rows, -1)  # [B, kvH, G*W, L]
    if rows == 1:
        probs = torch.cat([probs, probs], dim=2)
    out = torch.matmul(probs, values)[:, :, :rows]  # [B, kvH, G*W, D]
    return out.reshape(batch, heads, width, dim)


def elementwise_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Attention from elementwise products and reductions over one axis, in float32: no BLAS call,
    whose kernel depends on the row count. Shapes as for :func:`decode_attention`.  # [B, heads, W, D]"""
    batch, heads, width, dim = q.shape
    kv_heads = keys.shape[1]
    q = q.reshape(batch, kv_heads, heads // kv_heads, width, 1, dim).float()  # [B, kvH, G, W, 1, D]
    k = keys[:, :, None, None].float()  # [B, kvH, 1, 1, L, D]
    scores = (q * k).sum(-1) * scale  # [B, kvH, G, W, L]
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(-1)  # [B, kvH, G, W, L]
    out = (probs[..., None] * values[:, :, None, None].float()).sum(-2)  # [B, kvH, G, W, D]
    return out.reshape(batch, heads, width, dim).to(values.dtype)


__all__ = ["CHECKED_ROWS", "PackedLinear", "checked_row_counts", "decode_attention", "decode_attention_applies",
           "elementwise_attention", "grouped_attention", "pack_linears", "packable", "replace_linears",
           "tree_attention", "tree_order"]
