"""Decode kernels on CUDA whose rows do not depend on how many rows a pass has (Triton).

The CUDA half of :mod:`.kernels`: exact speculative decoding needs a verify pass of ``W`` tokens
to give each token, bit for bit, the logits ``W`` one-token steps would give it. torch's CUDA
kernels do not: cuBLAS picks its algorithm (split-K included) by the row count, SDPA picks its
kernel by the query length, and a reduction's launch shape follows the tensor's. (On an H200 with
those kernels, greedy speculation differed from plain decoding on 2-4 of 4 Spec-Bench prompts.)

The rules, fixed (never chosen by timing; a load-time check of results decides between them):

* **Linear layers and the output head** of decode-width passes (``W <= CUDA_DECODE_WIDTH``, 64):
  :func:`linear` — one Triton tile configuration for every row count (``BLOCK_M x BLOCK_N``
  output tiles, the inner dimension walked in ``BLOCK_K`` steps from 0, no split-K, float32
  accumulation; IEEE float32 products, never TF32; the inner dimension a compile-time constant:
  one compiled kernel per layer shape). A row's sums are the same instructions on
  the same data whichever tile it shares. :func:`checked_linear_mode` checks every row count to
  64 and a few to 256 against one-row products when a model is loaded: ``"triton"``, else
  ``"cublas"`` if cuBLAS passes for the shape, else ``"rows"`` (cuBLAS one row at a time:
  invariant by construction). Triton comes first because it is invariant by construction and
  the check only confirms it: a check of bfloat16 outputs can miss a kernel whose sums differ in
  order rarely enough that rounding hides it (seen on an AMX CPU with oneDNN), so a kernel that
  is invariant only by the check's evidence is the second choice. Prefill
  (wider passes) keeps cuBLAS: its tokens are shared by plain and speculative decoding, never
  compared with a verify pass's. ``SPECDRAFT_CUDA_LINEAR=split`` (:func:`split_linear`) tries a
  second Triton product first: the same tiles with the inner dimension cut into a fixed number of
  parts per weight shape (:func:`split_of`, never the row count), each part's sums written apart
  in float32 and added in part order by a second kernel, so that a one-row product of a weight
  with few output tiles (48 for a 3B model's 3072 outputs) keeps every SM reading. Still the
  same instructions on the same data for a row whatever tile it shares: row-invariant by
  construction, and checked like the other. Not the default until a GPU has measured it
  (``benchmarks/cuda_products.py``, the checklist's ``products`` and ``costs-graphs-split``).
* **Attention** of decode-width passes: :func:`decode_attention` — one program per (row, query
  head, token); the query's KV head read in place (GQA without copying keys); its keys walked in
  fixed blocks of ``BLOCK_N`` counted from position 0 with an online softmax in float32, so a
  fully masked block (the tail past the query, a wider span) leaves its sums exactly as they
  were (the block count is a compile-time constant: one compiled kernel per span). A tree token reads its keys through an order index (:func:`~.kernels.tree_order`): its
  committed positions, its ancestors by depth, then itself — the places its one-token step will
  find them at. Prefill keeps SDPA.
* **RMSNorm**: :func:`rms_norm`, one program per row.

Under ``torch.compile`` each is one opaque operator (``specdraft::cuda_linear``,
``specdraft::cuda_attention``, ``specdraft::cuda_rms_norm``), so inductor does not reorder their
sums; CUDA graphs capture their launches like any other kernel.

``SPECDRAFT_CUDA_KERNELS=stock`` (read when a model is loaded) turns all of this off: cuBLAS, SDPA
and torch's RMSNorm, fastest and not row-invariant — for measuring what invariance costs.

The kernels are plain Triton; they also run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, float32 and float16: the interpreter has no bfloat16), which is how the
tests check them on a machine without a GPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import triton
import triton.language as tl

#: ``SPECDRAFT_CUDA_KERNELS``: ``"invariant"`` (default) or ``"stock"``
KERNELS_ENV = "SPECDRAFT_CUDA_KERNELS"

#: the one tile configuration of :func:`linear` (every row count, every shape)
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
#: key positions per block of :func:`decode_attention` (blocks counted from position 0)
ATTENTION_BLOCK = 64

#: row counts a linear's kernel and RMSNorm are checked at when a model is loaded (as on CPU)
CHECKED_ROWS = (1, *range(2, 65), 96, 128, 192, 256)
#: pass widths the attention kernel is checked at when a model is loaded (and a tree of 6 tokens)
CHECKED_WIDTHS = tuple(range(1, 17))


def kernels_wanted() -> str:
    """``"invariant"`` or ``"stock"``, from :data:`KERNELS_ENV` (ValueError for anything else)."""
    value = os.environ.get(KERNELS_ENV, "invariant").strip().lower() or "invariant"
    if value not in ("invariant", "stock"):
        raise ValueError(f"{KERNELS_ENV} must be 'invariant' or 'stock' (got {value!r})")
    return value


# -- linear -------------------------------------------------------------------------------------


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_ys, stride_ym, stride_yn,
                   K: tl.constexpr, KS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # one output tile over the inner positions [s * KS, (s + 1) * KS) (s: axis 2; KS == K: all of
    # them, into y itself), walked in BK steps from its start
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, KS, BK):
        kk = pid_s * KS + k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + pid_s * stride_ys + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _split_sum_kernel(p_ptr, b_ptr, y_ptr, total, N, S: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # y = p[0] + p[1] + ... + p[S - 1] (+ bias), in that order, in float32: p is [S, M, N] contiguous
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < total
    acc = tl.load(p_ptr + i, mask=inside, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(p_ptr + s * total + i, mask=inside, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=inside)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x # [M, K] @ weight.T # [N, K]`` (+ ``bias # [N]``) with :data:`BLOCK_M` x :data:`BLOCK_N`
    tiles and :data:`BLOCK_K` steps whatever ``M`` is; float32 accumulation.  # [M, N]"""
    rows, inner = x.shape
    out = weight.shape[0]
    y = torch.empty((rows, out), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(out, BLOCK_N), 1)
    _linear_kernel[grid](x, weight, bias if bias is not None else weight, y, rows, out,
                         x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), 0, y.stride(0), y.stride(1),
                         K=inner, KS=inner, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                         BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=4)
    return y


#: :func:`split_linear`'s inner step, and the programs it aims at (about four per SM of an H100/H200)
SPLIT_BLOCK_K, SPLIT_PROGRAMS = 128, 512


def split_of(out: int, inner: int) -> int:
    """How many parts :func:`split_linear` splits the inner dimension of an ``[out, inner]`` weight
    into: the least power of two that makes :data:`SPLIT_PROGRAMS` programs of :data:`BLOCK_N`
    outputs each, at most 16 and each part at least two :data:`SPLIT_BLOCK_K` steps. A function of
    the shape alone (never of the row count, never of a timing): every row's sums are the same."""
    tiles, split = triton.cdiv(out, BLOCK_N), 1
    while tiles * split < SPLIT_PROGRAMS and split < 16 and inner >= 4 * SPLIT_BLOCK_K * split:
        split *= 2
    return split


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`triton_linear` with the inner dimension cut into :func:`split_of` parts of whole
    :data:`SPLIT_BLOCK_K` steps, each part's tile sums in float32 written apart, then added in part
    order by a second kernel: a decode product (``M`` of 1 to 16, one row tile) whose weight has
    few :data:`BLOCK_N`-wide tiles (a 3B model's 3072 outputs make 48, on 132 SMs) keeps every SM
    reading. ``SPECDRAFT_CUDA_LINEAR=split`` (:data:`LINEAR_ENV`) chooses it.  # [M, N]"""
    rows, inner = x.shape
    out = weight.shape[0]
    split = split_of(out, inner)
    part = triton.cdiv(triton.cdiv(inner, split), SPLIT_BLOCK_K) * SPLIT_BLOCK_K
    y = torch.empty((rows, out), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    to = y if split == 1 else torch.empty((split, rows, out), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(out, BLOCK_N), split)
    _linear_kernel[grid](x, weight, bias if bias is not None else weight, to, rows, out,
                         x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
                         0 if split == 1 else to.stride(0), to.stride(-2), to.stride(-1),
                         K=inner, KS=part, HAS_BIAS=bias is not None and split == 1, IEEE=x.dtype == torch.float32,
                         BM=BLOCK_M, BN=BLOCK_N, BK=SPLIT_BLOCK_K, num_warps=4, num_stages=4)
    if split > 1:
        total = rows * out
        _split_sum_kernel[(triton.cdiv(total, 1024),)](to, bias if bias is not None else weight, y, total, out, S=split,
                                                      HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4)
    return y


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """cuBLAS one row at a time: every row is a one-row product, so no row depends on the others."""
    return torch.cat([F.linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])]) if x.shape[0] else \
        F.linear(x, weight, bias)


#: the kernels a :class:`CudaLinear` may run, by mode name
LINEAR_MODES = {"cublas": F.linear, "triton": triton_linear, "split": split_linear, "rows": rows_linear}

#: ``SPECDRAFT_CUDA_LINEAR``: which Triton product decode-width passes try first, ``"tiles"``
#: (:func:`triton_linear`, the default) or ``"split"`` (:func:`split_linear`); read when a model loads
LINEAR_ENV = "SPECDRAFT_CUDA_LINEAR"


def linear_wanted() -> str:
    """The :data:`LINEAR_MODES` name of the Triton product :data:`LINEAR_ENV` asks for (ValueError
    for anything but ``tiles`` or ``split``)."""
    value = os.environ.get(LINEAR_ENV, "tiles").strip().lower() or "tiles"
    if value not in ("tiles", "split"):
        raise ValueError(f"{LINEAR_ENV} must be 'tiles' or 'split' (got {value!r})")
    return "triton" if value == "tiles" else "split"


def _linear_invariant(product, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``product``'s rows are bit-identical to one-row products at every count of
    :data:`CHECKED_ROWS`, for inputs at two alignments (random rows, a fixed seed)."""
    generator = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(CHECKED_ROWS[-1] + 1, weight.shape[1], generator=generator, device=weight.device)
    x = x.to(weight.dtype)
    alone = torch.cat([product(x[i:i + 1], weight, bias) for i in range(x.shape[0])])
    for n in CHECKED_ROWS[1:]:
        for offset in (0, 1):  # a pass's input does not always start where an allocation does
            if not torch.equal(product(x[offset:offset + n], weight, bias), alone[offset:offset + n]):
                return False
    return True


_CHECKED_MODES: dict[tuple, tuple[str, str]] = {}  # (out, in, dtype, bias, device) -> (mode, why)


def checked_linear_mode(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[str, str]:
    """``(mode, why)`` for a CUDA linear of this weight: the first of the Triton product
    :func:`linear_wanted` names (``"triton"`` or ``"split"``), ``"cublas"`` whose rows are
    bit-identical to one-row products at every checked row count (a check of results, never a
    timing), else ``"rows"``. Remembered per shape, dtype, device and wanted product."""
    wanted = linear_wanted()
    key = (*weight.shape, weight.dtype, bias is not None, str(weight.device), wanted)
    if key not in _CHECKED_MODES:
        with torch.inference_mode():
            if _linear_invariant(triton_linear if wanted == "triton" else split_linear, weight, bias):
                found = (wanted, "one tile configuration for every row count; checked at 1..64, 96..256 rows")
            elif _linear_invariant(F.linear, weight, bias):
                found = ("cublas", "Triton's rows differed by row count; cuBLAS's were bit-identical at 1..64, 96..256")
            else:
                found = ("rows", "neither Triton's tiles nor cuBLAS were row-invariant: one row at a time")
        _CHECKED_MODES[key] = found
    return _CHECKED_MODES[key]


class CudaLinear(nn.Module):
    """``nn.Linear`` on CUDA whose decode-width passes (``W <= decode_width``) run a row-invariant
    kernel (:attr:`mode`, from :func:`checked_linear_mode`) and wider ones (prefill) cuBLAS.

    ``weight # [out, in]`` and ``bias # [out]`` (or None) stay parameters of the same tensors.
    Under ``torch.compile`` the decode-width product is one opaque operator, ``specdraft::cuda_linear``.
    """

    def __init__(self, linear: nn.Linear, mode: str, decode_width: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.mode = mode
        self.decode_width = decode_width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 3 and x.shape[-2] > self.decode_width:  # prefill: cuBLAS
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)  # [rows, in]
        if torch.compiler.is_compiling():
            out = torch.ops.specdraft.cuda_linear(flat, self.weight, self.bias, self.mode)
        else:
            out = LINEAR_MODES[self.mode](flat.contiguous(), self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"mode={self.mode}"


@torch.library.custom_op("specdraft::cuda_linear", mutates_args=())
def _cuda_linear(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mode: str) -> torch.Tensor:
    return LINEAR_MODES[mode](flat.contiguous(), weight, bias)


@_cuda_linear.register_fake
def _(flat, weight, bias, mode):
    return flat.new_empty(flat.shape[0], weight.shape[0])


def cuda_linears(model: nn.Module, decode_width: int) -> dict:
    """Replace every float ``nn.Linear`` (a model on CUDA; on CPU, the tests' interpreted kernels) of ``model`` by a :class:`CudaLinear` whose mode the
    load-time check chose (in place, as :func:`~.kernels.replace_linears`). Returns a report:
    ``{"linear": {mode: count}, "linear_why": {mode: why}}``."""
    from .kernels import replace_linears

    modes: dict[str, int] = {}
    why: dict[str, str] = {}

    def convert(linear):
        mode, reason = checked_linear_mode(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        modes[mode] = modes.get(mode, 0) + 1
        why[mode] = reason
        return CudaLinear(linear, mode, decode_width)

    def applies(linear):
        return linear.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)

    replace_linears(model, convert, when=applies)
    return {"linear": modes, "linear_why": why}


# -- attention ----------------------------------------------------------------------------------


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, order_ptr, slot_ptr, out_ptr, scale, L,
                      sq_b, sq_h, sq_w, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_w, so_b, so_w, su_b, su_h, su_w,
                      H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCKS: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_SLOT: tl.constexpr):
    bh = tl.program_id(0)
    w = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // G
    if HAS_SLOT:  # the row's cache slot: keys and values read from the whole cache, in place
        kb = tl.load(slot_ptr + b).to(tl.int64)
    else:
        kb = b
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + w * sq_w + d, mask=dmask, other=0.0).to(tl.float32)
    m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), 0)  # a scalar -inf
    total = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    j = tl.arange(0, BLOCK)
    for block in range(0, BLOCKS):
        pos = block * BLOCK + j
        inside = pos < L
        if HAS_ORDER:
            idx = tl.load(order_ptr + b * so_b + w * so_w + pos, mask=inside, other=0)
        else:
            idx = pos
        seen = tl.load(mask_ptr + b * sm_b + w * sm_w + idx, mask=inside, other=0) != 0
        if tl.max(seen.to(tl.int32), 0) > 0:  # a block with nothing visible changes nothing: skip it
            kv_mask = seen[:, None] & dmask[None, :]
            k = tl.load(k_ptr + kb * sk_b + kvh * sk_h + idx[:, None] * sk_l + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], 1) * scale
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_ptr + kb * sv_b + kvh * sv_h + idx[:, None] * sv_l + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            total = total * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m = m_new
    out = acc / total
    tl.store(out_ptr + b * su_b + h * su_h + w * su_w + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def triton_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                     order: torch.Tensor | None = None, slot: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q # [B, heads, W, D]`` over ``keys``/``values # [B, kv_heads, L, D]`` (read in
    place; the last dimension contiguous) where ``mask # [B, 1, W, L]`` bool says what each token
    sees; ``order # [B, W, L]`` long (a tree): token ``w`` meets position ``order[b, w, j]`` ``j``-th,
    and sees it if ``mask[b, 0, w, order[b, w, j]]``. Scores, softmax and sums in float32; each
    token's sums over fixed blocks of :data:`ATTENTION_BLOCK` of its key sequence, from 0, with
    nothing shared between tokens. ``slot # [B]`` long: ``keys``/``values`` are the whole cache
    ``[slots, kv_heads, L, D]`` and row ``b`` reads slot ``slot[b]`` (no gathered copy). ``out``:
    where to write (a ``[B, heads, W, D]`` view, e.g. of a ``[B, W, heads, D]`` tensor).  # [B, heads, W, D], q's dtype"""
    batch, heads, width, dim = q.shape
    kv_heads, span = keys.shape[1], mask.shape[-1]
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        keys, values = keys.contiguous(), values.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    if out is None:
        out = torch.empty((batch, heads, width, dim), dtype=q.dtype, device=q.device)
    seen = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)
    if seen.stride(-1) != 1:
        seen = seen.contiguous()
    has_order = order is not None
    order_t = order if has_order else seen  # unused when there is no order
    so = (order_t.stride(0), order_t.stride(1)) if has_order else (0, 0)
    grid = (batch * heads, width)
    has_slot = slot is not None
    _attention_kernel[grid](q, keys, values, seen, order_t, slot if has_slot else seen, out, float(scale), span,
                            q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
                            values.stride(0), values.stride(1), values.stride(2), seen.stride(0), seen.stride(2),
                            so[0], so[1], out.stride(0), out.stride(1), out.stride(2),
                            H=heads, G=heads // kv_heads, D=dim, BLOCK_D=triton.next_power_of_2(dim),
                            BLOCK=ATTENTION_BLOCK, BLOCKS=triton.cdiv(span, ATTENTION_BLOCK), HAS_ORDER=has_order, HAS_SLOT=has_slot,
                            num_warps=4)
    return out


def decode_attention(q, keys, values, mask, scale, order=None) -> torch.Tensor:
    """:func:`triton_attention`; one opaque operator under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return torch.ops.specdraft.cuda_attention(q, keys, values, mask, scale, order)
    return triton_attention(q, keys, values, mask, scale, order)


@torch.library.custom_op("specdraft::cuda_attention", mutates_args=())
def _cuda_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                    order: torch.Tensor | None) -> torch.Tensor:
    return triton_attention(q, keys, values, mask, scale, order)


@_cuda_attention.register_fake
def _(q, keys, values, mask, scale, order):
    return q.new_empty(q.shape)


# -- RMSNorm ------------------------------------------------------------------------------------


@triton.jit
def _norm_row(x, w_ptr, cols, inside, N, eps):
    """transformers' RMSNorm of one row ``x`` (its dtype, zero past ``N``), in float32: normalised,
    rounded to ``x``'s dtype, times the weight."""
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / N
    h = (h * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    return w.to(tl.float32) * h.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, eps, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    y = _norm_row(x, w_ptr, cols, inside, N, eps)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (normalised in float32, cast to ``x``'s dtype, times the weight) with
    one program per row.  # x's shape, the dtype ``weight * x`` has"""
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    y = torch.empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if flat.shape[0]:
        _rms_norm_kernel[(flat.shape[0],)](flat, weight, y, dim, float(eps), flat.stride(0), y.stride(0),
                                           BLOCK=triton.next_power_of_2(dim), num_warps=4)
    return y.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`triton_rms_norm`; one opaque operator under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return torch.ops.specdraft.cuda_rms_norm(x, weight, eps)
    return triton_rms_norm(x, weight, eps)


@torch.library.custom_op("specdraft::cuda_rms_norm", mutates_args=())
def _cuda_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return triton_rms_norm(x, weight, eps)


@_cuda_rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


# -- the rest of a decoder layer: one kernel per stage (LeanOps) ------------------------------------


@triton.jit
def _add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, s_ptr, o_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=inside, other=0.0)
    y = tl.load(y_ptr + row * N + cols, mask=inside, other=0.0)
    total = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)  # one rounding of the sum, as torch's add
    tl.store(s_ptr + row * N + cols, total, mask=inside)
    y = _norm_row(total, w_ptr, cols, inside, N, eps)
    tl.store(o_ptr + row * N + cols, y.to(o_ptr.dtype.element_ty), mask=inside)


def triton_add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + y, rms_norm(x + y))``: the residual add and the next norm, one program per row."""
    x, y = x.contiguous(), y.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    dim = x.shape[-1]
    rows = x.numel() // dim
    if rows:
        _add_rms_norm_kernel[(rows,)](x, y, weight, total, out, dim, float(eps), BLOCK=triton.next_power_of_2(dim),
                                      num_warps=4)
    return total, out


@triton.jit
def _silu_mul_kernel(g_ptr, o_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    gate = tl.load(g_ptr + row * 2 * N + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(g_ptr + row * 2 * N + N + cols, mask=inside, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(o_ptr + row * N + cols, out.to(o_ptr.dtype.element_ty), mask=inside)


def triton_silu_mul(g: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``g = [gate ; up]`` (the fused gate/up product), elementwise in float32."""
    g = g.contiguous()
    n = g.shape[-1] // 2
    rows = g.numel() // (2 * n)
    out = g.new_empty(*g.shape[:-1], n)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, 1024))](g, out, n, BLOCK=1024, num_warps=4)
    return out


@triton.jit
def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, W, row_width,
                       sq_b, sq_h, sq_w, sk_s, sk_h, sk_l, sv_s, sv_h, sv_l,
                       H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    row = tl.program_id(0)  # b * W + w
    b = row // W
    w = row % W
    i = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + row * D + i).to(tl.float32)
    c2 = tl.load(cos_ptr + row * D + HALF + i).to(tl.float32)
    s1 = tl.load(sin_ptr + row * D + i).to(tl.float32)
    s2 = tl.load(sin_ptr + row * D + HALF + i).to(tl.float32)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    base = qkv_ptr + row * row_width
    for h in range(H):
        a = tl.load(base + h * D + i).to(tl.float32)
        c = tl.load(base + h * D + HALF + i).to(tl.float32)
        dst = q_ptr + b * sq_b + h * sq_h + w * sq_w
        tl.store(dst + i, (a * c1 - c * s1).to(q_ptr.dtype.element_ty))
        tl.store(dst + HALF + i, (c * c2 + a * s2).to(q_ptr.dtype.element_ty))
    for h in range(KV):
        a = tl.load(base + (H + h) * D + i).to(tl.float32)
        c = tl.load(base + (H + h) * D + HALF + i).to(tl.float32)
        dst = k_ptr + slot * sk_s + h * sk_h + pos * sk_l
        tl.store(dst + i, (a * c1 - c * s1).to(k_ptr.dtype.element_ty))
        tl.store(dst + HALF + i, (c * c2 + a * s2).to(k_ptr.dtype.element_ty))
        src = base + (H + KV + h) * D
        vdst = v_ptr + slot * sv_s + h * sv_h + pos * sv_l
        tl.store(vdst + i, tl.load(src + i))
        tl.store(vdst + HALF + i, tl.load(src + HALF + i))


def triton_rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor,
                      v_buf: torch.Tensor, slot: torch.Tensor, positions: torch.Tensor, heads: int,
                      kv_heads: int) -> torch.Tensor:
    """The fused q/k/v product's output ``qkv # [B, W, (heads + 2 kv_heads) D]`` rotated (``cos``,
    ``sin # [B, 1, W, D]``); keys and values written into ``k_buf``/``v_buf # [slots, kv_heads, L, D]``
    at ``slot # [B]``, ``positions # [B, W]``. One program per token.  # q [B, heads, W, D]"""
    batch, width = qkv.shape[:2]
    dim = k_buf.shape[-1]
    qkv, cos, sin, positions = qkv.contiguous(), cos.contiguous(), sin.contiguous(), positions.contiguous()
    q = qkv.new_empty(batch, heads, width, dim)
    if batch * width:
        _rope_write_kernel[(batch * width,)](qkv, cos, sin, q, k_buf, v_buf, slot, positions, width, qkv.shape[-1],
                                             q.stride(0), q.stride(1), q.stride(2), k_buf.stride(0), k_buf.stride(1),
                                             k_buf.stride(2), v_buf.stride(0), v_buf.stride(1), v_buf.stride(2),
                                             H=heads, KV=kv_heads, D=dim, HALF=dim // 2, num_warps=1)
    return q


def triton_lean_attention(q, k_buf, v_buf, slot, mask, scale, order=None) -> torch.Tensor:
    """:func:`triton_attention` over the cache buffers in place (row ``b`` reads slot ``slot[b]``),
    written straight into the output projection's layout.  # [B, W, heads * D]"""
    batch, heads, width, dim = q.shape
    out = q.new_empty(batch, width, heads, dim)
    triton_attention(q, k_buf, v_buf, mask, scale, order, slot=slot, out=out.transpose(1, 2))
    return out.view(batch, width, heads * dim)


def _compiled(op, direct):
    """``direct`` eagerly; the opaque operator ``op`` under ``torch.compile``."""
    def run(*args):
        return op(*args) if torch.compiler.is_compiling() else direct(*args)
    return run


@torch.library.custom_op("specdraft::cuda_add_rms_norm", mutates_args=())
def _cuda_add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_add_rms_norm(x, y, weight, eps)


@_cuda_add_rms_norm.register_fake
def _(x, y, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("specdraft::cuda_silu_mul", mutates_args=())
def _cuda_silu_mul(g: torch.Tensor) -> torch.Tensor:
    return triton_silu_mul(g)


@_cuda_silu_mul.register_fake
def _(g):
    return g.new_empty(*g.shape[:-1], g.shape[-1] // 2)


@torch.library.custom_op("specdraft::cuda_rope_write", mutates_args=("k_buf", "v_buf"))
def _cuda_rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor,
                     v_buf: torch.Tensor, slot: torch.Tensor, positions: torch.Tensor, heads: int,
                     kv_heads: int) -> torch.Tensor:
    return triton_rope_write(qkv, cos, sin, k_buf, v_buf, slot, positions, heads, kv_heads)


@_cuda_rope_write.register_fake
def _(qkv, cos, sin, k_buf, v_buf, slot, positions, heads, kv_heads):
    return qkv.new_empty(qkv.shape[0], heads, qkv.shape[1], k_buf.shape[-1])


@torch.library.custom_op("specdraft::cuda_lean_attention", mutates_args=())
def _cuda_lean_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slot: torch.Tensor,
                         mask: torch.Tensor, scale: float, order: torch.Tensor | None) -> torch.Tensor:
    return triton_lean_attention(q, k_buf, v_buf, slot, mask, scale, order)


@_cuda_lean_attention.register_fake
def _(q, k_buf, v_buf, slot, mask, scale, order):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1] * q.shape[3])


def lean_ops(width: int):
    """The layer's Triton operators as a :class:`~.model.LeanOps` (attention for passes of up to ``width`` tokens)."""
    from .model import LeanOps

    return LeanOps(rms_norm, _compiled(torch.ops.specdraft.cuda_add_rms_norm, triton_add_rms_norm),
                   _compiled(torch.ops.specdraft.cuda_rope_write, triton_rope_write),
                   _compiled(torch.ops.specdraft.cuda_lean_attention, triton_lean_attention),
                   _compiled(torch.ops.specdraft.cuda_silu_mul, triton_silu_mul), width)


# -- the load-time check and the fallbacks ---------------------------------------------------------


def per_token_attention(q, keys, values, mask, scale, order=None) -> torch.Tensor:
    """:func:`decode_attention` one token at a time: every token is a one-token call (the fallback
    when the load-time check finds the batched kernel's tokens depend on the pass)."""
    outs = [decode_attention(q[:, :, w:w + 1], keys, values, mask[:, :, w:w + 1], scale,
                             None if order is None else order[:, w:w + 1]) for w in range(q.shape[2])]
    return torch.cat(outs, dim=2)


def per_row_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm in torch, one row at a time (the fallback for :func:`rms_norm`)."""
    from .model import rms_norm as torch_rms_norm

    flat = x.reshape(-1, x.shape[-1])
    return torch.cat([torch_rms_norm(flat[i:i + 1], weight, eps) for i in range(flat.shape[0])]).reshape(x.shape)


def attention_invariant(kernel, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device,
                        widths=None, starts=(37, 70), span: int = 256) -> bool:
    """Whether ``kernel``'s tokens (``kernel(q, keys, values, mask, scale, order)``) are bit-identical
    to one-token calls over the keys their one-token steps see: two rows of ragged lengths, passes of
    ``widths`` tokens over a span wider than the one-token step's (a masked tail), and a tree (each
    token through its order index). Random inputs, a fixed seed: a check of results."""
    from .kernels import tree_order

    widths = CHECKED_WIDTHS if widths is None else widths
    generator = torch.Generator(device=device).manual_seed(0)
    batch = len(starts)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    keys, values = rand(batch, kv_heads, span, dim), rand(batch, kv_heads, span, dim)
    pos = torch.arange(span, device=device)
    scale = dim ** -0.5
    for width in widths:
        q = rand(batch, heads, width, dim)
        query = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)  # [B, W]
        mask = (pos[None, None, :] <= query[:, :, None])[:, None]  # [B, 1, W, span]
        out = kernel(q, keys, values, mask, scale, None)
        for w in range(width):
            step_span = 64 * (int(query.max()) // 64 + 1)  # the one-token step's span: shorter
            ref = kernel(q[:, :, w:w + 1], keys[:, :, :step_span], values[:, :, :step_span],
                         mask[:, :, w:w + 1, :step_span], scale, None)
            if not torch.equal(out[:, :, w:w + 1], ref):
                return False
    # a tree of 6 nodes after each row's committed positions: parents 0, 0, 1, 1, 2 of nodes 1..5
    parents, width = (-1, 0, 0, 1, 1, 2), 6
    own = torch.zeros(width, width, dtype=torch.bool, device=device)
    for node, parent in enumerate(parents):
        own[node, node] = True
        if parent >= 0:
            own[node] |= own[parent]
    mask = torch.zeros(batch, 1, width, span, dtype=torch.bool, device=device)
    for b, start in enumerate(starts):
        mask[b, 0, :, :start] = True
        mask[b, 0, :, start:start + width] = own
    order = tree_order(mask)  # [B, W, span]
    q = rand(batch, heads, width, dim)
    out = kernel(q, keys, values, mask, scale, order)
    depth = own.sum(-1)  # each node's ancestors and itself
    for w in range(width):
        # the token's one-token step: its committed positions, then its ancestors by depth, contiguous
        path = order[:, w, :max(starts) + width]  # [B, P]
        ref_keys = keys.gather(2, path[:, None, :, None].expand(-1, kv_heads, -1, dim))
        ref_values = values.gather(2, path[:, None, :, None].expand(-1, kv_heads, -1, dim))
        seen = torch.arange(path.shape[1], device=device)[None, :] < (torch.tensor(starts, device=device) + depth[w])[:, None]
        ref = kernel(q[:, :, w:w + 1], ref_keys, ref_values, seen[:, None, None], scale, None)
        if not torch.equal(out[:, :, w:w + 1], ref):
            return False
    return True


def rms_norm_invariant(kernel, dim: int, dtype: torch.dtype, device) -> bool:
    """Whether ``kernel(x, weight, eps)``'s rows are bit-identical to one-row calls at every count of
    :data:`CHECKED_ROWS`, at two alignments."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(CHECKED_ROWS[-1] + 1, dim, generator=generator, device=device).to(dtype)
    weight = torch.randn(dim, generator=generator, device=device).to(dtype)
    alone = torch.cat([kernel(x[i:i + 1], weight, 1e-5) for i in range(x.shape[0])])
    return all(torch.equal(kernel(x[o:o + n], weight, 1e-5), alone[o:o + n]) for n in CHECKED_ROWS[1:] for o in (0, 1))


def make_invariant(model: nn.Module, decode_width: int) -> dict:
    """Give ``model`` (a :class:`~.model.SpecdraftModel` on CUDA) row-invariant decode passes, in place:
    its linears (:func:`cuda_linears`), its attention modules' ``decode_kernel`` and its RMSNorms'
    ``kernel``, each chosen by a load-time check of results (the Triton kernel, else one token or
    row at a time). Returns what runs and why (the runner's ``info["kernels"]``)."""
    from .model import Attention, RMSNorm, use_lean

    if kernels_wanted() == "stock":
        return {"cuda": "stock", "why": f"{KERNELS_ENV}=stock: cuBLAS, SDPA, torch's RMSNorm (not row-invariant)"}
    if model.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return {"cuda": "stock", "why": f"{model.dtype}: cuBLAS and SDPA (rounding too fine to flip a greedy argmax)"}
    report = {"cuda": "invariant", **cuda_linears(model, decode_width)}
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    if attention:
        a = attention[0]
        dtype = a.wqkv.weight.dtype
        ok = attention_invariant(decode_attention, a.n_heads, a.n_kv_heads, a.head_dim, dtype, a.wqkv.weight.device)
        kernel = decode_attention if ok else per_token_attention
        report["attention"] = "triton" if ok else "per-token"
        for m in attention:
            m.decode_kernel = kernel
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    checked: dict[tuple, bool] = {}
    for m in norms:
        key = (m.weight.shape[0], m.weight.dtype)
        if key not in checked:
            checked[key] = rms_norm_invariant(rms_norm, key[0], key[1], m.weight.device)
        m.kernel = rms_norm if checked[key] else per_row_rms_norm
    report["rms_norm"] = "triton" if all(checked.values()) else "per-row where the check failed"
    if report.get("attention") == "triton" and all(checked.values()) and not any(m.q_norm is not None
                                                                                 for m in attention):
        use_lean(model, lean_ops(decode_width))  # the rest of each layer: one kernel per stage
        report["layers"] = "fused (rotary and cache write, residual add and norm, SwiGLU: one kernel each)"
    return report


__all__ = ["CHECKED_WIDTHS", "attention_invariant", "make_invariant", "per_row_rms_norm", "per_token_attention", "rms_norm_invariant",
           "ATTENTION_BLOCK", "BLOCK_K", "BLOCK_M", "BLOCK_N", "CHECKED_ROWS", "CudaLinear", "KERNELS_ENV",
           "LINEAR_ENV", "LINEAR_MODES", "checked_linear_mode", "linear_wanted", "split_linear", "split_of", "cuda_linears", "decode_attention", "kernels_wanted", "rms_norm",
           "lean_ops", "rows_linear", "triton_add_rms_norm", "triton_attention", "triton_lean_attention",
           "triton_linear", "triton_rms_norm", "triton_rope_write", "triton_silu_mul"]
