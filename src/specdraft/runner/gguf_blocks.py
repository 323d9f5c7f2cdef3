"""A GGUF file's own quantized blocks as the model's products (``quantize="gguf"``, CPU).

A GGUF target is dequantised into float weights when it loads (:mod:`specdraft.models`), and a
bfloat16 model then rounds those weights again: the default model's 4.5-bit Q4_1 blocks become
269 MB of bfloat16 that every decode step reads, where llama.cpp reads the file's 98 MB. With
``quantize="gguf"`` each linear layer whose GGUF tensor is Q4_0, Q4_1 or Q8_0 is a
:class:`BlockLinear` instead: the file's integers and float16 scales as they are, multiplied by
``specdraft_cpu::block_linear`` (:mod:`.cpu_ops`), which never stores a float weight. As llama.cpp
does, the product's inputs are rounded to 8 bits per group of 32 (one scale per group of a row),
the integers multiplied and summed exactly (AVX-512 VNNI where the processor has it), and each
group's sum scaled in float32; so a step reads about as many bytes as llama.cpp's and does a
quarter of the float work. The model is the file's, with llama.cpp's kind of rounding: close to
the float model (a test bounds it), not equal to it.

Each output is one fixed sequence of steps over its own row (exact integer sums, then the groups'
float32 terms in order), so the products are row-invariant by construction, as
:class:`~.cpu_ops.PanelLinear`'s are: a verify pass gives each token the logits one-token steps
give it, and speculation stays exact. Tensors of other types (F16, BF16, F32, the K-quants) keep
the float path's linears; ``runner.info["kernels"]["gguf_blocks"]`` counts the layers that run on
blocks. A float64 model (the parity tests) multiplies the dequantised blocks in float64.

Which tensor feeds which layer: ``attn_q``, ``attn_k`` and ``attn_v`` (the fused ``wqkv``; q and k
in the order llama.cpp's converter permuted them into, undone as transformers undoes it),
``attn_output``, ``ffn_gate`` and ``ffn_up`` (``w13``), ``ffn_down``, and ``output`` (else the tied
``token_embd``). Every block layer is checked against the loaded model's weight before it replaces
it (equal up to the model dtype's rounding), so a file the mapping misreads fails to load, with the
tensor's name, rather than running another model. The blocks are cached beside the converted
model (:data:`BLOCKS_CACHE`), so only the first load parses the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError

#: values per block (every block type here)
BLOCK = 32
#: output columns per panel (cpu_ops.PANEL)
PANEL = 16
#: GGUF block types this runs, and bytes per block: float16 d (and m), then the integers
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def read_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A GGUF tensor's raw bytes (``kind`` one of :data:`BLOCK_BYTES`, ``rows x cols`` values) as
    ``(q, d, m)``: ``q # [rows, cols]`` the integers (uint8 0..15 for 4-bit, int8 for Q8_0), ``d``
    and ``m # [rows, cols / 32]`` float16 (``m`` None for Q8_0; ``-8 d`` for Q4_0), so that the
    weight is ``d * q + m`` group by group."""
    size = BLOCK_BYTES[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // BLOCK, size)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows, cols)
        return q, d, None
    start = 4 if kind == "Q4_1" else 2
    packed = torch.from_numpy(blocks[..., start:].copy())  # [rows, groups, 16]: element j low, j + 16 high
    q = torch.cat([packed & 0xF, packed >> 4], dim=-1).reshape(rows, cols)
    if kind == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    else:
        m = d * -8  # exact in float16 (a power of two)
    return q, d, m


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight # [N, K]`` (K a multiple of 32) as Q4_1 blocks ``(q, d, m)``, as llama.cpp makes them
    (``m`` the group's minimum, ``d = (max - min) / 15``): for tests and models that come without a
    GGUF file."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    scale = torch.where(d.float() == 0, torch.zeros_like(lo), 1 / d.float())
    q = ((w - m.float()[..., None]) * scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), d, m


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """``weight # [N, K]`` (K a multiple of 32) as Q8_0 blocks ``(q, d, None)``, as llama.cpp makes
    them (``quantize_row_q8_0_ref``: ``d = absmax / 127`` per group, ``q = round(w / d)`` with the
    reciprocal of ``d`` in float32, ``d`` stored as float16): for weights that come without a GGUF
    file (a drafter's products, :meth:`specdraft.services.DrafterServices.fast_linear`)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = w.abs().amax(-1) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(w * inverse[..., None]).to(torch.int8)  # |w / d| <= 127: no clamp needed
    return q.reshape(n, k), d.half(), None


def q8_0_fits(linear: nn.Linear) -> bool:
    """Whether :func:`q8_0_linear` takes ``linear``: its inputs a whole number of blocks."""
    return linear.in_features % BLOCK == 0


def q8_0_linear(linear: nn.Linear) -> "BlockLinear":
    """``linear`` (:func:`q8_0_fits`) as a :class:`BlockLinear` of its weight's Q8_0 blocks
    (:func:`quantize_q8_0`), its bias as it is."""
    bias = None if linear.bias is None else linear.bias.detach()
    return BlockLinear(*quantize_q8_0(linear.weight), bias=bias, kind="Q8_0")


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    """``d * q + m`` per group, in ``dtype``."""
    n, k = q.shape
    w = q.to(dtype).reshape(n, k // BLOCK, BLOCK) * d.to(dtype)[..., None]
    if m is not None:
        w = w + m.to(dtype)[..., None]
    return w.reshape(n, k)


def pack_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None):
    """``(q, d, m)`` of :func:`read_blocks` in the layout ``specdraft_cpu::block_linear`` streams:
    panels of 16 output columns, group by group, chunks of 64 bytes holding 4 inputs of each column
    (4-bit: input 4r + j in the low nibble, 16 + 4r + j in the high one; 8-bit: q + 128, unsigned;
    see cpu_ops.cpp)."""
    n, k = q.shape
    pad = -n % PANEL
    p, g = (n + pad) // PANEL, k // BLOCK

    def panels(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [P, 16, ...], zero columns past N
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
        return t.reshape(p, PANEL, *t.shape[1:])

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [P, G, c, 4r] -> [P, G, r, c, j]
        return t.reshape(p, g, PANEL, -1, 4).permute(0, 1, 3, 2, 4)

    blocks = panels(q).reshape(p, PANEL, g, BLOCK).permute(0, 2, 1, 3)  # [P, G, c, i]
    if q.dtype == torch.uint8:  # 4-bit
        packed = chunks(blocks[..., :16]) | (chunks(blocks[..., 16:]) << 4)
    else:  # 8-bit, as unsigned q + 128 (the sign bit flipped)
        packed = chunks(blocks.contiguous().view(torch.uint8) ^ 0x80)
    scales = [None if t is None else panels(t).permute(0, 2, 1).contiguous() for t in (d, m)]
    return packed.reshape(p, g, -1).contiguous(), scales[0], scales[1]


def unpack_blocks(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, n: int):
    """The inverse of :func:`pack_blocks`: ``(q, d, m)`` of the first ``n`` output columns."""
    p, g, size = packed.shape

    def columns(t: torch.Tensor) -> torch.Tensor:  # [P, G, 16, ...] -> [N, G, ...]
        return t.transpose(1, 2).reshape(p * PANEL, g, *t.shape[3:])[:n]

    def inputs(t: torch.Tensor) -> torch.Tensor:  # [P, G, r, c, j] -> [P, G, c, 4r]
        return t.permute(0, 1, 3, 2, 4).reshape(p, g, PANEL, -1)

    chunks = packed.reshape(p, g, size // 64, PANEL, 4)
    if size == 256:  # 4-bit
        blocks = torch.cat([inputs(chunks & 0xF), inputs(chunks >> 4)], dim=-1)
    else:
        blocks = inputs((chunks ^ 0x80).view(torch.int8))
    return columns(blocks).reshape(n, -1), columns(d), None if m is None else columns(m)


class BlockLinear(nn.Module):
    """A linear layer of GGUF blocks (:func:`read_blocks`), no float weight: ``specdraft_cpu::block_linear``
    for float32 and bfloat16 inputs, the dequantised weight for float64 ones (the parity tests)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bias: torch.Tensor | None = None,
                 kind: str = "") -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.kind = kind or ("Q8_0" if q.dtype == torch.int8 else "Q4_1")
        packed, pd, pm = pack_blocks(q, d, m)
        self.register_buffer("q", packed)
        self.register_buffer("d", pd)
        self.register_buffer("m", pm)
        self.register_buffer("bias", bias)
        self.nbytes = sum(t.numel() * t.element_size() for t in (packed, pd, pm) if t is not None)
        self._float64: torch.Tensor | None = None  # the dequantised weight, made on first float64 use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            if self._float64 is None:
                blocks = unpack_blocks(self.q, self.d, self.m, self.out_features)
                self._float64 = dequantize(*blocks, dtype=torch.float64)
            bias = None if self.bias is None else self.bias.double()
            return nn.functional.linear(x, self._float64, bias)
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.specdraft_cpu.block_linear(flat, self.q, self.d, self.m, self.bias, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"{self.kind} blocks"


def llama_permutation(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's converter's permutation of q or k (transformers'
    ``reverse_permute_weights``): rows ``[heads, dim, 2]`` read as ``[heads, 2, dim]``."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


#: beside a converted GGUF folder's weights: the file's blocks as safetensors, so a second load
#: skips parsing the file (about 6 s for the default model: its metadata holds the vocabulary)
BLOCKS_CACHE = "gguf-blocks.safetensors"


def _stamp(gguf: Path) -> str:
    st = gguf.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def file_blocks(gguf: str | Path, cache: Path | None = None) -> tuple[dict[str, tuple], dict[str, str]]:
    """The blocks of ``gguf``'s tensors of a type in :data:`BLOCK_BYTES` (``{name: (q, d, m)}``, as
    :func:`read_blocks` gives them) and every tensor's type (``{name: "Q4_1"}``); read from
    ``cache`` when it was written from this very file, else from the file (and written to ``cache``)."""
    import json

    from safetensors.torch import load_file, save_file

    gguf = Path(gguf)
    if cache is not None and cache.is_file():
        from safetensors import safe_open

        with safe_open(str(cache), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("source") == _stamp(gguf):
            tensors = load_file(str(cache))
            kinds = json.loads(meta["kinds"])
            return {name: (tensors[f"{name}.q"], tensors[f"{name}.d"], tensors.get(f"{name}.m"))
                    for name, kind in kinds.items() if kind in BLOCK_BYTES}, kinds
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    blocks, kinds = {}, {}
    for t in reader.tensors:
        kinds[t.name] = kind = t.tensor_type.name
        if kind in BLOCK_BYTES and len(t.shape) == 2:
            cols, rows = (int(x) for x in t.shape)
            blocks[t.name] = read_blocks(t.data, kind, rows, cols)
    if cache is not None:
        flat = {f"{name}.{part}": t.contiguous() for name, b in blocks.items() for part, t in zip("qdm", b)
                if t is not None}
        tmp = cache.with_name(f"{cache.name}.tmp")
        try:
            save_file(flat, str(tmp), metadata={"source": _stamp(gguf), "kinds": json.dumps(kinds)})
            tmp.replace(cache)
        except OSError:  # a read-only cache folder: the next load reads the file again
            tmp.unlink(missing_ok=True)
    return blocks, kinds


def _file_blocks(blocks: dict, kinds: dict, name: str, rows_perm: torch.Tensor | None = None):
    """``((q, d, m), kind)`` of GGUF tensor ``name``, or ``(None, kind)`` when its type has no blocks here."""
    if name not in kinds:
        raise ConfigError(f"quantize='gguf': the GGUF file has no tensor {name!r}; load it without --quantize gguf")
    if name not in blocks:
        return None, kinds[name]
    q, d, m = blocks[name]
    if rows_perm is not None:
        q, d = q[rows_perm], d[rows_perm]
        m = None if m is None else m[rows_perm]
    return (q, d, m), kinds[name]


def _joined(parts: list[tuple]) -> tuple | None:
    """One layer's blocks from several tensors' (stacked by rows), or None when their types do not mix."""
    kinds = {("8" if p[0].dtype == torch.int8 else "4") for p in parts}
    if len(kinds) != 1:
        return None
    q = torch.cat([p[0] for p in parts])
    d = torch.cat([p[1] for p in parts])
    m = None if parts[0][2] is None else torch.cat([p[2] for p in parts])
    return q, d, m


def _check(name: str, blocks: tuple, weight: torch.Tensor) -> None:
    """ConfigError unless ``weight`` is the blocks' weight up to its dtype's rounding."""
    want = dequantize(*blocks)
    got = weight.detach().float()
    eps = torch.finfo(weight.dtype).eps if weight.dtype.is_floating_point else 0.0
    if got.shape != want.shape or not torch.all((got - want).abs() <= eps * want.abs() + 1e-6):
        raise ConfigError(f"quantize='gguf': the GGUF file's {name} does not match the model's weight (a layout "
                          "this loader does not know); load it without --quantize gguf")


def use_blocks(model, folder: str | Path) -> dict:
    """Replace ``model``'s linear layers (a SpecdraftModel of the Llama family, CPU) by
    :class:`BlockLinear` s of the tensors of the GGUF file ``folder`` was converted from
    (:func:`~specdraft.models.gguf_source`) where their types allow (read through the folder's
    :data:`BLOCKS_CACHE`, see :func:`file_blocks`); returns ``{"gguf_blocks": "n of m layers
    (types)"}`` for ``runner.info["kernels"]``. The caller has loaded :mod:`.cpu_ops`, whose operator
    the layers call."""
    from ..models import gguf_source

    gguf = gguf_source(folder)
    if gguf is None:
        raise ConfigError("quantize='gguf' runs a GGUF file's own blocks: load the target from a .gguf file "
                          "(or the default model)")
    blocks, file_kinds = file_blocks(gguf, Path(folder) / BLOCKS_CACHE)
    args = model.args
    q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    done, total, kinds = 0, 0, set()

    def swap(parent, attr: str, names: list[str], perms: list) -> None:
        nonlocal done, total
        total += 1
        linear = getattr(parent, attr)
        found = [_file_blocks(blocks, file_kinds, n, p) for n, p in zip(names, perms)]
        kinds.update(kind for _, kind in found)
        if any(b is None for b, _ in found):
            return
        joined = _joined([b for b, _ in found])
        if joined is None:
            return
        _check(" + ".join(names), joined, linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        kind = "+".join(sorted({k for _, k in found}))
        setattr(parent, attr, BlockLinear(*joined, bias=bias, kind=kind))
        done += 1

    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        attn, ffn = layer.attention, layer.feed_forward
        swap(attn, "wqkv", [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"],
             [llama_permutation(q_rows, args.n_heads), llama_permutation(kv_rows, args.n_kv_heads), None])
        swap(attn, "wo", [b + "attn_output.weight"], [None])
        swap(ffn, "w13", [b + "ffn_gate.weight", b + "ffn_up.weight"], [None, None])
        swap(ffn, "w2", [b + "ffn_down.weight"], [None])
    head = "output.weight" if "output.weight" in file_kinds else "token_embd.weight"
    swap(model, "output", [head], [None])
    if not done:
        raise ConfigError(f"quantize='gguf' runs Q4_0, Q4_1 and Q8_0 tensors; this file's layers are "
                          f"{', '.join(sorted(kinds))}: load it without --quantize gguf")
    return {"gguf_blocks": f"{done} of {total} layers ({', '.join(sorted(kinds))})"}


__all__ = ["BLOCKS_CACHE", "BLOCK_BYTES", "BlockLinear", "dequantize", "file_blocks", "pack_blocks", "q8_0_fits",
           "q8_0_linear", "quantize_q4_1", "quantize_q8_0", "llama_permutation", "read_blocks", "unpack_blocks", "use_blocks"]
