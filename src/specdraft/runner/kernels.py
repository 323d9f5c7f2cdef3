"""Decode kernels on CPU whose rows do not depend on how many rows a pass has.

Speculative decoding is exact only if a verify pass of ``W`` tokens gives each token, bit for
bit, the logits ``W`` one-token steps would give it: a bfloat16 model rounds coarsely enough that
any other rounding flips greedy argmaxes (9 of 13 Spec-Bench outputs differed from plain
decoding before these kernels). And it pays only if that pass costs about one step. torch's
default CPU kernels give neither: the product's kernel, and so its summation order, is chosen by
the row count, and float32 products of 2-5 rows cost up to 30x a one-row product on an AMD EPYC.

The rules, fixed (never chosen by timing), from measurements on a 2-core AMD EPYC (AVX-512 with
``avx512_bf16``) and a 2-core Intel Xeon (family 6 model 207, with AMX: ``amx_bf16``,
``amx_tile``, and ``avx512_bf16``), torch 2.13 CPU; ``benchmarks/row_invariance.py`` reprints
them on any machine:

* **Linear layers and the output head** (float32 and bfloat16 on CPU): oneDNN with the weight
  prepacked once (:class:`PackedLinear`). On the EPYC, for every shape of SmolLM2-135M and of
  larger models (up to 2048 x 8192), every row count from 2 to 48 gave rows bit-identical to a
  2-row product in both dtypes, while one row takes another kernel once the inner dimension is
  1152 or more; so a single row runs as two (the row twice) unless the load-time check finds
  one-row products equal to those (:func:`one_row_checked`: on the Xeon below, at every shape). It is also the fastest kernel
  measured there: bfloat16, the 3072 x 576 product 0.04 ms at 1 row and 0.08 at 16 (MKL's
  ``F.linear`` 0.12 / 0.19), the 49152 x 576 head 0.6 / 1.6 ms (2.4 / 3.9). On the Xeon oneDNN's
  bfloat16 products run on AMX, row-invariant up to 32 rows for every shape of SmolLM2-135M
  (and 96 x 1536) but summing in another order from 33 rows on (inner dimensions of 64 or less:
  every count to 256); bfloat16's rounding hides most of it (about 1 row in 100 of a 96-wide
  product differs, 1 in 30 of a 576-wide one), so random rows let such counts pass by luck. Its
  float32 products passed every count to 256. AMX is worth keeping: 16 rows of the 3072 x 576
  product take 0.20 ms and of the head 3.2 ms on one thread there, 0.72 and 13.9 ms with oneDNN
  held to ``avx512_bf16`` (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, which made every count pass).
  Because kernels differ between processors, each shape is *checked* when a model is packed
  (:func:`checked_row_counts`, a check of results, not a timing): every row count to 64 and a few
  to 256, bit-identity on :func:`check_inputs`, random rows and cancelling rows (whose results are
  pure rounding residues: a change of summation order shows in nearly every element; random rows
  alone let the Xeon's counts 33..192 pass for a 96 x 1536 bfloat16 shape); a pass runs as
  products of checked counts only, so a count that fails on some processor is never used there
  (one row at a time at worst), and :func:`pack_linears` reports it. On the Xeon every bfloat16
  shape of SmolLM2-135M stops at 32 (a 300-row pass: products of 32 and a rest), and the counts
  that passed held in every window of 2048 other random rows (512 for the head) and of four other
  sets of cancelling rows (all shapes but the head). The checks take 1.0-1.2 s of loading it
  there (0.7 s with random rows only), 2.8-3.4 s in float32, where every count passes (2.4-3.0 s).
* **Attention of decode-width passes** (:func:`decode_attention`): bfloat16 and float16, each KV
  head's query rows (``G`` heads x ``W`` tokens) against its keys as one batched product, the
  softmax in float32, then the probabilities against the values in blocks of
  :data:`VALUE_BLOCK` positions (:func:`blocked_values`), the blocks' results summed in float32.
  The scores' product (inner length: the head dimension) was row-invariant at every row count from
  2 on both machines (a pass always has ``G >= 2`` rows or duplicates its one row). The values'
  product over a whole span was on the EPYC (spans to 2048), but not on the Xeon's AMX: it sums in
  another order from 33 rows per KV head at spans of 512 or more, from 16 rows at 8192 positions,
  and from as few as 3 when the batch holds a single KV head (one KV head, one sequence) and two
  threads run it; products of 128 positions were row-invariant there for 2..128 rows (256 too,
  512 not). The blocks cost 10-40% of attention's time there, the most at short spans (one
  thread: a 16-token pass over 1024 positions 0.68 -> 0.80 ms, one token over 64 0.09 -> 0.12),
  nothing measurable in a SmolLM2-135M pass (35-58 ms there, 1-16 tokens after 100 or 1000).
  float32: elementwise products and reductions over one axis (MKL's float32 products are not
  row-invariant at any row count), in chunks of query rows so the intermediate stays small. On the
  EPYC both forms (bfloat16's then with one product over the span) gave the same bits for 1..16
  query tokens and spans of 64..2048 positions with the tail masked; on the Xeon bfloat16 and
  float16 with blocks did for 1..32 tokens (up to 96 query rows per KV head) and spans to 16384
  (the blocks are not measured on the EPYC yet). float64 uses SDPA.
* **Quantized layers** (int8/int4, :mod:`.quantize`) compute each row alone already.
* **Products in panels** (:class:`~.cpu_ops.PanelLinear`): on a CPU with AVX-512 or AVX2, float32 and
  bfloat16 linears (on AMD with ``avx512_bf16``, by pairs of inputs in the same order) take specdraft's
  own product instead of oneDNN's: one fused multiply-add per input in order for each output, so
  row-invariant by construction (no check), and faster at the row counts of decoding, AMX's tiles
  included (see ``docs/algorithm.md``, "Products in panels"); ``SPECDRAFT_CPU_PRODUCTS=onednn``
  keeps oneDNN's checked products, which prefill faster on AMX.

CUDA has its own rules and Triton kernels: :mod:`.cuda_kernels`. Not covered: float64 (the
parity tests' dtype: its rounding is too fine to flip a greedy argmax).
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
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
        #: whether one row may run alone (checked: :func:`one_row_checked`); else it runs as two
        self.one_row = False
        handle = next(_HANDLES)
        _PACKED[handle] = self
        self.register_buffer("handle", torch.tensor(handle), persistent=False)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """One oneDNN product of ``flat # [rows, in]`` (at least 2 rows).  # [rows, out]"""
        return torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")

    def apply(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat # [rows, in]`` -> ``[rows, out]``, by the row rule (one row as two; products of checked counts)."""
        rows = flat.shape[0]
        if rows == 1 and not self.one_row:  # the one-row kernel sums in another order: run the row twice
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
    """The row counts products of ``module``'s shape are checked to take with every row
    bit-identical to a 2-row product of that row alone: :data:`CHECKED_ROWS` (every count to 64,
    then a few to 256) up to the first that fails (deterministic: a fixed seed). Remembered per
    shape, dtype, bias and thread count. ``(1,)`` means row by row.

    The products are a :class:`PackedLinear` of ``module``'s shape, dtype and bias (a zero one) on
    :func:`check_inputs`: its rows alternate random ones and cancelling ones, whose results are
    pure float32 rounding residues. Random rows show a product that sums in another order only
    now and then (the result's rounding hides most of it: about 1 bfloat16 row in 100 of a
    96-wide product on the Xeon of the module's docstring, where every count from 33 to 192 passed
    on them); cancelling rows in nearly every element."""
    key = _check_key(module)
    if key in _CHECKED_COUNTS:
        return _CHECKED_COUNTS[key]
    weight, rows = check_inputs(module.out_features, module.in_features, CHECKED_ROWS[-1])
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.to(module.dtype), requires_grad=False)
    if module.bias is not None:
        linear.bias = nn.Parameter(torch.zeros_like(module.bias), requires_grad=False)
    probe = PackedLinear(linear)
    rows = rows.to(module.dtype)
    with torch.inference_mode():
        alone = torch.cat([probe.product(rows[i:i + 1].expand(2, -1).contiguous())[:1] for i in range(rows.shape[0])])
        passed = (1,)
        for n in CHECKED_ROWS[1:]:
            if not torch.equal(probe.product(rows[:n]), alone[:n]):
                break
            passed += (n,)
        # whether a one-row product sums as the others do (on the EPYC of the module's docstring
        # not from an inner dimension of 1152 on; on the AMX Xeon at every SmolLM2-135M shape)
        _ONE_ROW[key] = all(torch.equal(probe.product(rows[i:i + 1]), alone[i:i + 1]) for i in range(64))
    _CHECKED_COUNTS[key] = passed
    return passed


_ONE_ROW: dict[tuple, bool] = {}  # as _CHECKED_COUNTS: whether one row may run alone


def one_row_checked(module: PackedLinear) -> bool:
    """Whether :func:`checked_row_counts` found one-row products of ``module``'s shape equal to
    the two-row products :meth:`PackedLinear.apply` otherwise runs a single row as (every row of
    the first 64 of its check inputs); then a one-row pass skips the copy."""
    checked_row_counts(module)
    return _ONE_ROW[_check_key(module)]


def _check_key(module: PackedLinear) -> tuple:
    """What the checks' results are remembered by: the shape, dtype, bias and thread count."""
    return module.out_features, module.in_features, module.dtype, module.bias is not None, torch.get_num_threads()


#: distinct weight rows of :func:`check_inputs` (a larger weight repeats them)
CHECK_WEIGHT_ROWS = 1024


def check_inputs(out_features: int, in_features: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight # [out, in], rows # [count, in])``, float32, random normal values (a fixed seed),
    for :func:`checked_row_counts`. The inputs pair up at random places (``2 * (in // 2)`` of
    them) where a pair's weights are equal; the odd rows' values are opposite in each pair, so
    that their exact product is zero while its partial sums are not: the result is the rounding
    residue of the partial sums, which changes with almost any change of summation order, however
    it is rounded afterwards. The even rows are plain random rows. Past :data:`CHECK_WEIGHT_ROWS`
    the weight's rows repeat (each output is still summed on its own)."""
    generator = torch.Generator().manual_seed(0)
    half = in_features // 2
    order = torch.randperm(in_features, generator=generator)
    first, second = order[:half], order[half:2 * half]
    distinct = min(out_features, CHECK_WEIGHT_ROWS)  # repeated below: a random 49152 x 576 weight took 0.3 s
    weight = torch.randn(distinct, in_features, generator=generator)
    weight[:, second] = weight[:, first]
    weight = weight.repeat(-(-out_features // distinct), 1)[:out_features]
    rows = torch.randn(count, in_features, generator=generator)
    cancelling = rows[1::2]
    cancelling[:, second] = -cancelling[:, first]
    if in_features % 2:
        cancelling[:, order[-1]] = 0
    return weight, rows


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
    as :func:`replace_linears` does), each checked by :func:`checked_row_counts`; those
    :func:`~.cpu_ops.panels_apply` takes by a :class:`~.cpu_ops.PanelLinear` instead (row-invariant
    by construction, unchecked).

    Returns ``{"packed": n}`` (and ``"panels": m``, how many of those are PanelLinears) plus, for
    each checked module whose shape failed the check, its name and the
    largest row count that passed (nothing else: every count in :data:`CHECKED_ROWS` passed)."""
    from . import cpu_ops

    def pack(linear):
        if cpu_ops.panels_apply(linear):  # AVX-512 or AVX2, unless SPECDRAFT_CPU_PRODUCTS=onednn
            return cpu_ops.PanelLinear(linear)
        packed = PackedLinear(linear)
        packed.counts = checked_row_counts(packed)
        packed.one_row = one_row_checked(packed)
        return packed

    replaced = replace_linears(model, pack, when=lambda lin: cpu_ops.panels_apply(lin) or packable(lin))
    panels = sum(isinstance(m, cpu_ops.PanelLinear) for m in replaced.values())
    report = {"packed": len(replaced)} | ({"panels": panels} if panels else {})
    report.update({name: m.counts[-1] for name, m in replaced.items()
                   if isinstance(m, PackedLinear) and m.counts != CHECKED_ROWS})
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


#: positions per product of attention's probabilities and values (:func:`grouped_attention`)
VALUE_BLOCK = 128


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Each KV head's ``G x W`` query rows against its keys as batched products (bfloat16 or
    float16 on CPU: oneDNN), the softmax in float32. Scores are ``keys @ queries.T`` so the cache's
    keys are read in place (no transposed copy); a single query row of a single head is run twice
    so that no product has one row or column. The probabilities meet the values in blocks of
    :data:`VALUE_BLOCK` positions (:func:`blocked_values`). Shapes as for :func:`decode_attention`.  # [B, heads, W, D]"""
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
    out = blocked_values(probs, values)[:, :, :rows]  # [B, kvH, G*W, D] float32
    return out.to(values.dtype).reshape(batch, heads, width, dim)


def blocked_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``probs @ values`` as products of exactly :data:`VALUE_BLOCK` positions (the last block
    padded with zeros), one batched product for all blocks, their results summed in float32, block
    by block, over the position axis as :func:`elementwise_attention` sums. Every product then has
    the same inner length whatever the span, and one short enough that oneDNN's row-count
    dependent choices do not reach it (see the module's docstring: one product over the whole
    span summed in another order from 33 rows on, on an AMX Xeon).

    ``probs # [B, kvH, R, L]``, ``values # [B, kvH, L, D]`` (bfloat16 or float16).  # [B, kvH, R, D] float32"""
    batch, kv_heads, rows, span = probs.shape
    dim = values.shape[-1]
    full = span // VALUE_BLOCK * VALUE_BLOCK
    parts = []
    if full:  # views of the cache's values: [B, kvH, blocks, VALUE_BLOCK, D]
        blocks = probs[..., :full].reshape(batch, kv_heads, rows, -1, VALUE_BLOCK).transpose(2, 3)
        parts.append(torch.matmul(blocks, values[:, :, :full].reshape(batch, kv_heads, -1, VALUE_BLOCK, dim)))
    if full < span:  # the last, short block, padded to a whole one
        pad = VALUE_BLOCK - (span - full)
        tail = F.pad(probs[..., full:], (0, pad))[:, :, None]  # [B, kvH, 1, R, VALUE_BLOCK]
        parts.append(torch.matmul(tail, F.pad(values[:, :, full:], (0, 0, 0, pad))[:, :, None]))
    partial = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [B, kvH, blocks, R, D]
    return partial.transpose(2, 3).to(torch.float32, memory_format=torch.contiguous_format).sum(-2)


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


__all__ = ["CHECKED_ROWS", "PackedLinear", "VALUE_BLOCK", "blocked_values", "check_inputs", "checked_row_counts",
           "decode_attention", "decode_attention_applies", "elementwise_attention", "grouped_attention", "one_row_checked",
           "pack_linears",
           "packable", "replace_linears", "tree_attention", "tree_order"]
