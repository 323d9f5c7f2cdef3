"""Weight-only int8 and int4 linears for the model runner (and any other module tree).

:func:`quantize_int8` swaps every ``nn.Linear`` of a model, in place, for an
:class:`Int8Linear`: int8 weights with one symmetric scale per output channel
(``scale = absmax(row) / 127``), activations and bias left in floating point.
:func:`quantize_int4` does the same with :class:`Int4Linear`: 4-bit weights, an asymmetric
scale and zero point per group of 32/64/128/256 input features (CPU only).

Which arithmetic runs, by the dtype the product is computed in (``compute_dtype``; int8's
default is the float weight's dtype, int4's is bfloat16):

* float32, bfloat16, float16 (CPU; for int8 also CUDA where torch has the kernel):
  ``torch.ops.aten._weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``. On x86 CPUs with
  AVX-512 or AVX2 only bfloat16 is vectorised; float32 and float16 are a scalar loop (torch
  2.13), correct but several times slower than ``F.linear`` on the float weights. So on CPU
  the fast setting is bfloat16 activations: a bfloat16 model, or ``compute_dtype=
  torch.bfloat16`` on a float32 one (inputs cast to bfloat16 for the product, output cast back).
* float64 inputs (the parity tests), and int8 on a device without the kernel: the same
  dequantised weights in the input's dtype, ``x @ (weight.to(x.dtype) * scales[:, None]).T``.

Measured on a 2-core Intel Xeon (AVX-512, torch 2.13), the linears of one SmolLM2-135M
decode step (30 layers + the 49152-row head, 1 row, distinct weights per layer; two runs):
float32 ``F.linear`` 33-40 ms, bfloat16 ``F.linear`` 27-34 ms, int8 bfloat16 kernel 15-18 ms,
int4 bfloat16 kernel (group 32) 7-8 ms; the float32 int8 kernel ~100 ms. A whole 1-token step
of the model: float32 ~45 ms, int8 with bfloat16 products ~34 ms, int4 ~22 ms. ``torch.compile``
of dequantise-then-matmul does not fuse into anything faster than eager ``F.linear``.

Determinism and row-independence (same machine; checked by ``tests/runner/test_quantize.py``):
both CPU kernels compute each output element from its own input row alone, accumulating over
the input features in a fixed order (rows are blocked by 4, but a block's rows never mix), and
each block is computed by one thread. So the result is bit-identical run after run, and row
``i`` of ``f(x)`` equals ``f(x[i:i+1])`` for any number of rows (checked 1..33 and up to 600):
a verify pass of K+1 positions gives the same products as K+1 one-token steps. Plain float32
``F.linear`` and float32 SDPA on CPU are *not* row-independent (a 1-row product takes another
path than a 2-row one), so a float32 model stays row-dependent in its attention; a bfloat16
model with quantized linears was bitwise equal between a 4-token pass and 4 single steps. The
float64 fallback (BLAS) is deterministic but not row-independent: tolerance-based tests only.
On CUDA, row-independence of the int8 kernel is not verified.

Kernel preconditions handled here: the bfloat16 int8 CPU kernel reads 16 input features at a
time with aligned loads (a width that is not a multiple of 16, or an input at an unaligned
storage offset, crashes the process), so in eager the input is made contiguous and 64-byte
aligned (not under ``torch.compile``: see ``Int8Linear._kernel``), and such a width is
zero-padded (input and weight, per call: exact, but slow; no model of interest has one). The
int4 kernel wants the output features in multiples of 16 and the input features in multiples
of the group size: the weight is zero-padded once at quantization, the input per call.

Under ``torch.compile(fullgraph=True)`` both modules trace, and the compiled result equals the
eager one bit for bit (tested): the kernels' scales are passed as stored (inductor's lowering
of ``_weight_int8pack_mm`` rejects a cast there) and the bias is added in float32 and rounded
once, as inductor would fuse it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import replace_linears

#: dtypes ``_weight_int8pack_mm`` accepts (its scales must have the input's dtype)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the CPU kernel steps through the input features 16 (AVX-512) or 8 (AVX2, NEON) at a time
_K_MULTIPLE = 16
_ALIGN = 64  # bytes

_cuda_kernel: dict[torch.dtype, bool] = {}


def _kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    if dtype not in KERNEL_DTYPES:
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    if dtype not in _cuda_kernel:  # older torch builds have no CUDA kernel, some only for some dtypes
        try:
            x = torch.zeros(1, 32, dtype=dtype, device=device)
            torch.ops.aten._weight_int8pack_mm(x, torch.zeros(8, 32, dtype=torch.int8, device=device),
                                               torch.ones(8, dtype=dtype, device=device))
            _cuda_kernel[dtype] = True
        except (RuntimeError, NotImplementedError):
            _cuda_kernel[dtype] = False
    return _cuda_kernel[dtype]


def quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(q # [out, in] int8, scales # [out] scale_dtype)`` with
    ``weight ~= q * scales[:, None]``. The scale is rounded to ``scale_dtype`` first and the
    weights are rounded against that stored scale. All-zero rows get scale 1 (and q = 0)."""
    w = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    absmax = w.abs().amax(dim=1)
    if not torch.isfinite(absmax).all():
        raise ValueError("cannot quantize a weight with inf or nan entries")
    scales = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax)).to(scale_dtype)
    q = torch.round(w / scales.to(w.dtype)[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights, one scale per output channel; forward on ``[..., in]``.

    Buffers: ``weight # [out, in] int8``, ``scales # [out]`` (the float weight's dtype, or
    ``compute_dtype`` when given), ``bias # [out]`` or None (the float weight's dtype).
    ``compute_dtype``: the dtype the kernel's product runs in (None: the float weight's, i.e. the
    model's); inputs of another dtype are cast to it and the output cast back, except float64
    inputs, which take the dequantised float64 product. Build one with :meth:`from_linear`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 device=None, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if compute_dtype is not None and compute_dtype not in KERNEL_DTYPES:
            raise ValueError(f"compute_dtype must be one of {KERNEL_DTYPES}, not {compute_dtype}")
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=compute_dtype or dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype | None = None) -> Int8Linear:
        """The int8 version of ``linear`` (whose weight is only read, never changed)."""
        w = linear.weight
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=w.dtype,
                     device=w.device, compute_dtype=compute_dtype)
        module.weight, module.scales = quantize_rows(w, module.scales.dtype)
        if linear.bias is not None:
            module.bias = linear.bias.detach().clone()
        return module

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight this module computes with.  # [out, in]"""
        dtype = dtype or self.scales.dtype
        return self.weight.to(dtype) * self.scales.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)  # [rows, in]
        dtype = self.scales.dtype  # compute_dtype, or the float weight's dtype: the kernel's scales match it
        if x.dtype != torch.float64 and _kernel_available(x.device, dtype):
            out = self._kernel(flat.to(dtype))
        else:  # float64 and the like: the same dequantised product, in the input's dtype
            out = F.linear(flat, self.dequantized(x.dtype))
        return _add_bias(out, self.bias, x.dtype).view(*shape[:-1], self.out_features)

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        pad = -self.in_features % _K_MULTIPLE
        if pad:
            flat, weight = F.pad(flat, (0, pad)), F.pad(weight, (0, pad))
        flat = flat.contiguous()
        # the bfloat16 CPU kernel's aligned loads crash the process on an unaligned input. Eager: checked
        # here. Compiled: data_ptr() cannot be traced and inductor drops a defensive clone, so the input
        # must not be a view at an odd storage offset (in the runner's block every linear's input is a
        # fresh buffer)
        if flat.device.type == "cpu" and not torch.compiler.is_compiling():
            if flat.data_ptr() % _ALIGN:
                flat = flat.clone()  # a fresh CPU allocation is 64-byte aligned
            if weight.data_ptr() % _ALIGN:
                weight = weight.clone()
        # scales are passed as stored: a cast here would be a pointwise node that inductor's lowering
        # of this op rejects (torch 2.13)
        return torch.ops.aten._weight_int8pack_mm(flat, weight, self.scales)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scales={self.scales.dtype}, compute_dtype={self.compute_dtype}")


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``(out + bias).to(dtype)``, the sum in at least float32 and rounded once (what inductor
    makes of the same ops, so compiled and eager agree bit for bit)."""
    if bias is None:
        return out.to(dtype)
    acc = torch.promote_types(out.dtype, torch.float32)
    return (out.to(acc) + bias.to(acc)).to(dtype)


def quantize_int8(model: nn.Module, compute_dtype: torch.dtype | None = None) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by an :class:`Int8Linear`, in place; return
    how many were replaced. Only modules of type exactly ``nn.Linear`` are replaced; others
    (embeddings, norms, a non-``nn.Linear`` head, subclasses of ``nn.Linear``) are left alone.
    A linear whose weight is shared with another module (an output head tied to the token
    embeddings) gets int8 copies; the shared float weight stays where it was. A linear that
    appears twice in the tree is replaced by one shared module. ``compute_dtype``: see
    :class:`Int8Linear` (``torch.bfloat16`` for a float32 model on CPU, where only the bfloat16
    kernel is fast)."""
    return len(replace_linears(model, lambda m: Int8Linear.from_linear(m, compute_dtype)))


#: group sizes ``_weight_int4pack_mm_for_cpu`` accepts
INT4_GROUP_SIZES = (32, 64, 128, 256)
_INT4_N_MULTIPLE = 16  # the CPU packing wants the output features in multiples of 16


def quantize_groups(weight: torch.Tensor, group_size: int,
                    scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of ``group_size`` input features (the layout of torchao /
    gpt-fast's int4): ``weight ~= (q - 8) * scale + zero`` per group, ``q`` in 0..15. Returns
    ``(q # [out, in] int32, scales # [out, in // group_size], zeros # same)``, scales and zeros
    rounded to ``scale_dtype`` first, ``q`` rounded against the stored values."""
    out_features, in_features = weight.shape
    w = weight.detach().float().view(out_features, in_features // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
        raise ValueError("cannot quantize a weight with inf or nan entries")
    scales = ((high - low) / 15).clamp(min=1e-6).to(scale_dtype)
    zeros = (low + 8 * scales.float()).to(scale_dtype)
    s, z = scales.float()[..., None], zeros.float()[..., None]
    q = (torch.round((w - z) / s) + 8).clamp_(0, 15).to(torch.int32)
    return q.view(out_features, in_features), scales, zeros


class Int4Linear(nn.Module):
    """``nn.Linear`` with 4-bit weights, one scale and zero point per group of ``group_size``
    input features; forward on ``[..., in]``. CPU only (the weight is in the CPU kernel's packed
    layout).

    Buffers: ``weight`` (uint8, ``_convert_weight_to_int4pack_for_cpu``'s layout of the
    ``[out, in]`` 4-bit values, both padded as the kernel needs: ``out`` to a multiple of 16
    with zero rows, ``in`` to a multiple of ``group_size`` with zero columns),
    ``scales_and_zeros # [in_padded // group_size, out_padded, 2]`` in ``compute_dtype``,
    ``bias # [out]`` or None (the float weight's dtype).

    ``compute_dtype`` (the dtype the scales are stored and the product runs in, default
    bfloat16): float32, bfloat16 or float16 run ``torch.ops.aten._weight_int4pack_mm_for_cpu``
    (on x86 only bfloat16 is vectorised; float32 is a scalar loop, far slower than
    ``F.linear``). Inputs of another dtype are cast to it and the output cast back, except
    float64, which takes :meth:`dequantized` and ``F.linear`` in float64 (tests only). Like the
    int8 kernel, the int4 one computes each output row from its own input row in a fixed order:
    deterministic and row-independent (see the module docstring).
    """

    def __init__(self, in_features: int, out_features: int, group_size: int = 32, bias: bool = False,
                 dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, not {group_size}")
        if compute_dtype not in KERNEL_DTYPES:
            raise ValueError(f"compute_dtype must be one of {KERNEL_DTYPES}, not {compute_dtype}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.compute_dtype = compute_dtype
        self.in_padded = in_features + (-in_features % group_size)
        self.out_padded = out_features + (-out_features % _INT4_N_MULTIPLE)
        # [out_padded, in_padded / 2] is the packed shape; the layout inside depends on the CPU's kernel
        self.register_buffer("weight", torch.zeros(self.out_padded, self.in_padded // 2, dtype=torch.uint8))
        sz = torch.zeros(self.in_padded // group_size, self.out_padded, 2, dtype=compute_dtype)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32,
                    compute_dtype: torch.dtype = torch.bfloat16) -> Int4Linear:
        """The 4-bit version of ``linear`` (whose weight is only read, never changed)."""
        w = linear.weight
        if w.device.type != "cpu":
            raise ValueError(f"Int4Linear runs on CPU only, the weight is on {w.device}")
        module = cls(linear.in_features, linear.out_features, group_size, bias=linear.bias is not None,
                     dtype=w.dtype, compute_dtype=compute_dtype)
        padded = F.pad(w.detach().float(), (0, module.in_padded - module.in_features,
                                            0, module.out_padded - module.out_features))
        q, scales, zeros = quantize_groups(padded, group_size, compute_dtype)
        module.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        module.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        if linear.bias is not None:
            module.bias = linear.bias.detach().clone()
        return module

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        """The kernel on ``flat # [rows, in]`` in ``compute_dtype``.  # [rows, out]"""
        pad = self.in_padded - self.in_features
        flat = (F.pad(flat, (0, pad)) if pad else flat).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group_size, self.scales_and_zeros)
        return out[:, :self.out_features] if self.out_padded != self.out_features else out

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight the kernel multiplies by, read back through the kernel itself (an
        identity input, in float32), so nothing here depends on the packed layout.  # [out, in]"""
        eye = torch.eye(self.in_features, self.in_padded, device=self.weight.device)  # zero padded columns
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight, self.group_size,
                                                       self.scales_and_zeros.float())
        return w[:, :self.out_features].T.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)  # [rows, in]
        if x.dtype == torch.float64:  # the parity tests' dtype: no kernel, the same weights in float64
            out = F.linear(flat, self.dequantized(torch.float64))
        else:
            out = self._product(flat.to(self.compute_dtype))
        return _add_bias(out, self.bias, x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, compute_dtype={self.compute_dtype}")


def quantize_int4(model: nn.Module, group_size: int = 32, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """:func:`quantize_int8`'s 4-bit twin: every ``nn.Linear`` (exact type) inside ``model``
    becomes an :class:`Int4Linear` (CPU only), in place; returns how many were replaced."""
    return len(replace_linears(model, lambda m: Int4Linear.from_linear(m, group_size, compute_dtype)))
