"""The decoder layer on CPU in ten operators: a small C++ extension (``cpu_ops.cpp``) for its glue and attention.

A bfloat16 decode step of SmolLM2-135M in torch operators dispatched 76 operators per layer (38
that do work, the rest views) and spent more time in them and in attention than in its four
products. These five operators replace them, each one loop over rows (row-invariant by
construction, as the products of :mod:`.kernels` are by check):

* ``rms_norm(x, weight, eps)``: transformers' RMSNorm (normalised in float32, rounded, times the weight);
* ``add_rms_norm(x, y, weight, eps) -> (x + y, rms_norm(x + y))``: the residual add and the next norm;
* ``rope_write(qkv, cos, sin, k_buf, v_buf, slot, positions, heads, kv_heads) -> q``: the fused
  q/k/v product's output rotated, keys and values written into the cache;
* ``attention(q, k_buf, v_buf, slot, mask, scale, order) -> [B, W, heads * head_dim]``: over the
  cache buffers in place (grouped KV heads read where they are; no gather of a batch's slots);
  float32 scores, softmax and weighted sum, positions in order, masked ones skipped, so a
  token's result is the same in a pass of any width and over any masked tail; ``order``: a
  tree pass's positions in the order its one-token step meets them;
* ``silu_mul(g) -> silu(gate) * up`` of the fused gate/up product.

and around the layers, ``pass_tables(starts, width, span, table, window) -> (positions, mask, cos,
sin)``: what a pass without a tree attends with, in one call (:data:`PASS_TABLES`, read by
:func:`~.model.run_blocks`).

With the four products (:class:`~specdraft.runner.kernels.PackedLinear`) a layer dispatches ten
operators that do work. Arithmetic is float32 with each output rounded once to the model's dtype
(float32, bfloat16, float16); float64 models keep torch's operators (the parity tests' dtype).

The extension is compiled once per machine (about a minute on 2 cores) into
``cache_dir()/cpu-ops/`` by torch's ``cpp_extension`` with ``-O3 -march=native -fopenmp`` (the
machine's own vector units: built where it runs; attention's work items spread over torch's threads); ``scripts/install.sh`` builds it. Without a C++ compiler
(or with ``SPECDRAFT_CPU_OPS=torch``) the model keeps torch's operators, equally exact, slower;
``runner.info["kernels"]["cpu_ops"]`` says which runs and why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import ConfigError

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
#: the compiler's flags: the machine's own vector units, and OpenMP, without which ``at::parallel_for``
#: in the extension runs on one thread
FLAGS = ["-O3", "-march=native", "-fopenmp"]
#: a file in the OpenMP build's folder: that build failed where the one without OpenMP worked
NO_OPENMP = "no-openmp"
#: why the extension runs on one thread ("" when it runs on torch's threads); set by :func:`load`
ONE_THREAD = ""
#: ``specdraft_cpu::pass_tables`` once :func:`load` has loaded the extension (what
#: :func:`~.model.run_blocks` computes a pass's positions, mask and rotary rows with on CPU), else None
PASS_TABLES = None
#: dtypes the operators serve
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def load() -> str:
    """Build (once per machine and source) and load the extension; ``""`` when its operators are
    registered (and :data:`PASS_TABLES` set), else why not (no compiler, a build error,
    ``SPECDRAFT_CPU_OPS=torch``)."""
    global PASS_TABLES
    reason = _load()
    if not reason:
        PASS_TABLES = torch.ops.specdraft_cpu.pass_tables.default
    return reason


def _load() -> str:
    """:func:`load`'s work: the extension registered, or why not."""
    if os.environ.get("SPECDRAFT_CPU_OPS", "").lower() == "torch":
        return "SPECDRAFT_CPU_OPS=torch"
    check_kernel_envs()  # a value the kernels do not know is refused before anything is built
    global ONE_THREAD
    if hasattr(torch.ops, "specdraft_cpu") and hasattr(torch.ops.specdraft_cpu, "attention"):
        return ""
    from ..models import cache_dir

    scripts = os.path.dirname(sys.executable)  # the environment's ninja (a dependency), unactivated too
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils import cpp_extension  # imports setuptools, which an environment may lack
    except Exception as exc:  # noqa: BLE001
        return f"the C++ extension cannot be built here ({_first_error(exc)}); torch's operators run instead"

    errors: list[str] = []
    threaded = _build_dir(FLAGS, cache_dir())
    for flags in (FLAGS, [f for f in FLAGS if f != "-fopenmp"]):  # a compiler without OpenMP: one thread, still built
        build = _build_dir(flags, cache_dir())
        build.mkdir(parents=True, exist_ok=True)
        if (build / NO_OPENMP).is_file():  # this compiler built the extension only without OpenMP: not tried again
            errors.append((build / NO_OPENMP).read_text())
            continue
        try:
            # a name per build: torch renames a second build of one name in a process (..._v1), which
            # the next process would not find
            name = "specdraft_cpu_ops" if "-fopenmp" in flags else "specdraft_cpu_ops_serial"
            cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build),
                               extra_cflags=flags, extra_ldflags=[f for f in flags if f == "-fopenmp"],
                               is_python_module=False, verbose=False)
            break
        except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a build error: torch's operators serve
            errors.append(_first_error(exc))
    else:
        return f"the C++ extension did not build ({errors[-1]}); torch's operators run instead"
    if errors:  # built without OpenMP: remember that for this source, and say so in the runner's info
        (threaded / NO_OPENMP).write_text(errors[0])
        ONE_THREAD = f"built without OpenMP ({errors[0][:120]})"
    _register_fakes()
    return ""


#: ``T0`` or ``T1``: where the panel products' software prefetches land, L1 or L2, instead of the
#: choice by vendor (L2 on AMD, L1 elsewhere: see ``prefetch_to_l2`` in cpu_ops.cpp); to measure it
PREFETCH_ENV = "SPECDRAFT_PREFETCH"
#: ``1`` or ``0``: bfloat16 panels multiplied by pairs of inputs (``avx512_bf16``) or in widened
#: float32 lanes, instead of the choice by vendor (pairs on AMD: see ``pairs_here`` in cpu_ops.cpp);
#: to measure and test both
PAIRS_ENV = "SPECDRAFT_BF16_PAIRS"
#: ``panels`` (the default) or ``onednn``: which kernel runs a CPU model's float32 and bfloat16
#: products where both can (:func:`panels_apply`). oneDNN's are row-invariant by a load-time check
#: (:func:`~.kernels.checked_row_counts`); on a processor with AMX they prefill long prompts about
#: twice as fast and decode about half as fast, so a server whose requests are long prompts with short
#: answers may want them there
PRODUCTS_ENV = "SPECDRAFT_CPU_PRODUCTS"
#: the values the kernels understand of each variable they read, and what to tell a user who set another
_KERNEL_ENVS = {
    PREFETCH_ENV: (("T0", "T1"), "set it to T0 (the products prefetch into L1) or T1 (into L2), "
                                 "or unset it to choose by the processor's vendor"),
    PAIRS_ENV: (("0", "1"), "set it to 1 (bfloat16 products by pairs of inputs, avx512_bf16) or 0 (in float32 "
                            "lanes), or unset it to choose by the processor's vendor"),
    PRODUCTS_ENV: (("panels", "onednn"), "set it to panels (specdraft's products, the default) or onednn (oneDNN's, "
                                         "checked at load: faster prefill on a processor with AMX, slower decoding)"),
}


def kernel_env(name: str, default: str | None = None) -> str | None:
    """The variable ``name`` of :data:`_KERNEL_ENVS` (``default`` where it is unset); a value the
    kernels would not understand is refused."""
    values, hint = _KERNEL_ENVS[name]
    value = os.environ.get(name)
    if value is not None and value not in values:
        raise ConfigError(f"{name}={value!r}: {hint}")
    return default if value is None else value


def check_kernel_envs() -> None:
    """Refuse a value of any of :data:`_KERNEL_ENVS` that the kernels would not understand."""
    for name in _KERNEL_ENVS:
        kernel_env(name)


def _build_dir(flags: list[str], cache: Path) -> Path:
    """The folder of a build with ``flags``: one per source, torch version and flags."""
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()
    return cache / "cpu-ops" / digest[:12]


def _first_error(exc: Exception) -> str:
    """The line of a build's exception that says what went wrong (200 characters at most)."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    line = next((x for x in lines if "error" in x.lower() and "building extension" not in x), lines[0])
    return line.strip()[:200]


def _register_fakes() -> None:
    """Shapes for torch.compile (the operators stay opaque in a compiled graph)."""
    lib = "specdraft_cpu::"

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "add_rms_norm")
    def _(x, y, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake(lib + "silu_mul")
    def _(g):
        return g.new_empty(*g.shape[:-1], g.shape[-1] // 2)

    @torch.library.register_fake(lib + "rope_write")
    def _(qkv, cos, sin, k_buf, v_buf, slot, positions, heads, kv_heads):
        return qkv.new_empty(qkv.shape[0], heads, qkv.shape[1], k_buf.shape[3])

    @torch.library.register_fake(lib + "attention")
    def _(q, k_buf, v_buf, slot, mask, scale, order):
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1] * q.shape[3])

    @torch.library.register_fake(lib + "pass_tables")
    def _(starts, width, span, table, window):
        rows, dim = starts.shape[0], table.shape[2]
        return (starts.new_empty(rows, width), starts.new_empty(rows, 1, width, span, dtype=torch.bool),
                table.new_empty(rows, 1, width, dim), table.new_empty(rows, 1, width, dim))

    @torch.library.register_fake(lib + "linear")
    def _(x, panels, bias, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake(lib + "decoder_layer")
    def _(x, attention_norm, ffn_norm, eps, kinds, outs, wqkv, wo, w13, w2, cos, sin, k_buf, v_buf, slot, positions,
          mask, scale, order, heads, kv_heads):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "block_linear")
    def _(x, q, d, mn, bias, out_features):
        return x.new_empty(x.shape[0], out_features)


#: output columns per panel of :class:`PanelLinear`'s weight (one AVX-512 register of float32, two AVX2 ones)
PANEL = 16


def panels_apply(linear: torch.nn.Module) -> bool:
    """Whether :class:`PanelLinear` replaces ``linear`` (a CPU ``nn.Linear``, float32 or bfloat16) on
    this machine: the extension built with AVX-512 or AVX2 and FMA (``vector_bits``; without them the
    operator is a correct but scalar loop), unless :data:`PRODUCTS_ENV` asks for oneDNN's products
    and oneDNN serves the linear's dtype here. On AMD processors with ``avx512_bf16`` bfloat16 is
    multiplied by pairs of inputs (:func:`pack_panels`). On a 2-core Zen 4 EPYC (family 25 model 17,
    no AMX) a step's one-row products took 12.1 ms against oneDNN's 19.4; on a 2-core Xeon with AMX
    (family 6 model 167) 10.3-10.6 against 15.5-16.3, and a decode step 10.2 ms against 20.3, though
    oneDNN's AMX tiles take a 256-row prefill's products in half the panels' time (docs/benchmarks.md)."""
    from .kernels import packable

    if type(linear) is not torch.nn.Linear or linear.weight.device.type != "cpu":
        return False
    if linear.weight.dtype not in (torch.float32, torch.bfloat16) or vector_bits() == 0:
        return False
    return kernel_env(PRODUCTS_ENV, "panels") == "panels" or not packable(linear)


def vector_bits() -> int:
    """The vector width the extension's panel products were built for on this machine: 512
    (AVX-512), 256 (AVX2 with FMA), or 0 (not built, or neither: a scalar loop, too slow to use)."""
    return int(torch.ops.specdraft_cpu.vector_bits()) if load() == "" else 0


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight # [N, K]`` as panels of :data:`PANEL` output columns, ``[ceil(N / 16), K, 16]`` (the
    last padded with zero columns), what ``specdraft_cpu::linear`` streams. A bfloat16 weight with an
    even K, where the extension multiplies by pairs (``avx512_bf16``: ``specdraft_cpu::bf16_pairs``),
    is stored ``[P, K / 2, 16, 2]`` with each pair's two inputs swapped (input k + 1, then k: the
    instruction adds the second first), viewed as the same shape."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -n % PANEL))
    if weight.dtype == torch.bfloat16 and load() == "" and torch.ops.specdraft_cpu.bf16_pairs(k):
        pairs = padded.view(-1, PANEL, k // 2, 2).flip(-1)  # [P, 16, K / 2, 2], (k + 1, k)
        return pairs.permute(0, 2, 1, 3).contiguous().view(-1, k, PANEL)
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


class PanelLinear(torch.nn.Module):
    """An ``nn.Linear`` (float32 or bfloat16) as ``specdraft_cpu::linear``: row-invariant by construction.

    Each output is one float32 sum over the inputs in order, one fused multiply-add at a time, then
    the bias, rounded once to the dtype: the same arithmetic whatever the row count, so no load-time
    check is needed (oneDNN's :class:`~.kernels.PackedLinear` is row-invariant by check). The weight
    is stored once, as panels (:func:`pack_panels`); a one-row product streams it at the memory's
    speed. Measured on a 2-core Intel Xeon without native bfloat16 (family 6 model 85, AVX-512):
    docs/benchmarks.md, "Products in panels".
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        reason = load()
        if reason:
            raise RuntimeError(f"PanelLinear needs specdraft's C++ operators: {reason}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.nbytes = weight.numel() * weight.element_size()
        self.register_buffer("panels", pack_panels(weight))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # [rows, in] already: a drafter's head, one row per sequence
            return torch.ops.specdraft_cpu.linear(x, self.panels, self.bias, self.out_features)
        flat = x.reshape(-1, self.in_features)  # [rows, in]
        out = torch.ops.specdraft_cpu.linear(flat, self.panels, self.bias, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"{str(self.dtype).removeprefix('torch.')} panels"


def applies(model) -> str:
    """``""`` if ``model``'s layers can run on these operators (CPU, a dtype of :data:`DTYPES`, no
    per-head q/k norms, the extension built), else why not."""
    if model.device.type != "cpu":
        return "not on a CPU"
    if model.dtype not in DTYPES:
        return f"{model.dtype} keeps torch's operators"
    if getattr(model.args, "qk_norm", False):
        return "per-head q/k norms (Qwen3) keep torch's operators"
    return load()


def use(model) -> dict:
    """Make ``model``'s blocks (and norms) run on these operators where :func:`applies`; returns
    ``{"cpu_ops": "yes"}`` (``"yes, on one thread: ..."`` when built without OpenMP) or
    ``{"cpu_ops": reason}`` for ``runner.info["kernels"]``."""
    reason = applies(model)
    if reason:
        return {"cpu_ops": reason}
    from .model import DECODE_WIDTH, LeanOps, RMSNorm, use_lean

    ops = torch.ops.specdraft_cpu
    use_lean(model, LeanOps(ops.rms_norm, ops.add_rms_norm, ops.rope_write, ops.attention, ops.silu_mul, DECODE_WIDTH))
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.kernel is None:
            module.kernel = ops.rms_norm
    pages = on_huge_pages(model)  # before the fused layers take their tensors
    fused = 0
    for block in getattr(model, "layers", ()):
        block.fused = fused_layer(block)
        fused += block.fused is not None
    whole = 0
    if hasattr(model, "fused_layers"):  # a SpecdraftModel: all its layers in one call
        model.fused_layers = fused_layers(model.layers)
        whole = len(model.layers) if model.fused_layers is not None else 0
    report = {"cpu_ops": f"yes, on one thread: {ONE_THREAD}" if ONE_THREAD else "yes"}
    level = int(ops.prefetch_level())  # where the panel products' prefetches land (PREFETCH_ENV)
    return report | ({"fused_layers": fused} if fused else {}) | ({"layers_in_one_call": whole} if whole else {}) | \
        ({"huge_pages": pages} if pages else {}) | ({"prefetch": f"L{level}"} if level else {})


#: 2 MiB: the size of a transparent huge page on x86-64 and arm64 Linux
HUGE_PAGE = 2 << 20


def huge_pages_reason() -> str:
    """``""`` where the weights can be put on transparent huge pages (Linux, THP not ``never``,
    ``SPECDRAFT_HUGE_PAGES`` not ``0``), else why not."""
    import mmap

    if os.environ.get("SPECDRAFT_HUGE_PAGES", "") == "0":
        return "SPECDRAFT_HUGE_PAGES=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "no transparent huge pages on this system"
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "no transparent huge pages on this system"
    return "transparent huge pages are off ([never])" if "[never]" in mode else ""


def on_huge_pages(model) -> str:
    """Move the products' weights (panels, GGUF blocks) into one anonymous mapping advised
    ``MADV_HUGEPAGE``; returns ``"N MB"`` moved, or ``""`` (nothing to move, or why not in
    :func:`huge_pages_reason`).

    A step reads every weight once, so with 4 KiB pages every 4 KiB of weights is a TLB miss a
    step (67,000 for the default model's 269 MB); a 2 MiB page is one. Where transparent huge pages
    are ``madvise`` (many distributions' default) torch's allocations never get them. The same
    values at new addresses: the bits of every product are unchanged."""
    import mmap

    from .gguf_blocks import BlockLinear

    if huge_pages_reason():
        return ""
    names = {PanelLinear: "panels", BlockLinear: "q"}  # each product's weight tensor
    owners = [(m, names[type(m)]) for m in model.modules() if type(m) in names]
    if not owners:
        return ""
    sizes = [getattr(m, name).numel() * getattr(m, name).element_size() for m, name in owners]
    total = sum(n + (-n % 64) for n in sizes)
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive as long as a view of it lives
    offset = -raw.data_ptr() % HUGE_PAGE
    for (module, name), n in zip(owners, sizes):
        old = getattr(module, name)
        new = raw[offset : offset + n].view(old.dtype).view(old.shape)
        new.copy_(old)
        setattr(module, name, new)
        offset += n + (-n % 64)
    return f"{total / 1e6:.0f} MB"


def _product(linear) -> tuple[int, list] | None:
    """A product as ``specdraft_cpu::decoder_layer`` takes it: ``(0, [panels, bias])`` for a
    :class:`PanelLinear`, ``(1, [q, d, mn, bias])`` for a :class:`~.gguf_blocks.BlockLinear`, else None."""
    from .gguf_blocks import BlockLinear

    if type(linear) is PanelLinear:
        return 0, [linear.panels, linear.bias]
    if type(linear) is BlockLinear:
        return 1, [linear.q, linear.d, linear.m, linear.bias]
    return None


class _LayerArgs(NamedTuple):
    """A block's arguments of ``specdraft_cpu::decoder_layer``: its norms' weights (the first None
    for an identity) and epsilon, each product's kind, width and tensors, the heads and the scale."""

    norms: tuple
    kinds: list
    outs: list
    tensors: list
    heads: tuple
    scale: float


def _layer_args(block) -> _LayerArgs | None:
    """``block``'s :class:`_LayerArgs` (see :func:`fused_layer`), or None where it cannot be one call."""
    from .model import RMSNorm, TransformerBlock

    attention, ffn = block.attention, block.feed_forward
    linears = (attention.wqkv, attention.wo, ffn.w13, ffn.w2)
    products = [_product(m) for m in linears]
    first = block.attention_norm  # an identity in EAGLE's layer, which reads its input unnormalised
    if type(block) is not TransformerBlock or any(p is None for p in products) or attention.q_norm is not None or \
            not (type(first) is torch.nn.Identity or (type(first) is RMSNorm and first.eps == block.ffn_norm.eps)):
        return None
    norms = (getattr(first, "weight", None), block.ffn_norm.weight, block.ffn_norm.eps)
    return _LayerArgs(norms, [k for k, _ in products], [m.out_features for m in linears], [w for _, w in products],
                      (attention.n_heads, attention.n_kv_heads), attention.head_dim**-0.5)


def fused_layer(block):
    """``block`` (a TransformerBlock on these operators) as one call of ``specdraft_cpu::decoder_layer``
    (the same operators, called from C++), where its four products are panels or GGUF blocks and it
    has no per-head q/k norms (an identity for its first norm, as EAGLE's layer has, is fine); else
    None (each operator called from Python)."""
    args = _layer_args(block)
    if args is None:
        return None
    op = torch.ops.specdraft_cpu.decoder_layer.default
    norms, kinds, outs, tensors, heads, scale = args

    def layer(x, cos, sin, mask, k_buf, v_buf, slot, positions, order):
        return op(x, *norms, kinds, outs, *tensors, cos, sin, k_buf, v_buf, slot, positions, mask, scale, order,
                  *heads)

    return layer


def fused_layers(blocks):
    """Every block of ``blocks`` as one call of ``specdraft_cpu::decoder_layers`` (each layer's
    ``decoder_layer`` in turn from C++, on the cache's buffers cut to the span there), where each
    can be one call (:func:`fused_layer`) and they share heads, scale and epsilon; else None.
    ``layers(x, cos, sin, mask, k_bufs, v_bufs, span, slot, positions, order, collect) -> (out,
    the inputs of the layers in collect)``."""
    args = [_layer_args(block) for block in blocks]
    if not args or any(a is None for a in args) or len({(a.norms[2], a.heads, a.scale) for a in args}) != 1:
        return None
    op = torch.ops.specdraft_cpu.decoder_layers.default
    attention_norms, ffn_norms = [a.norms[0] for a in args], [a.norms[1] for a in args]
    kinds, outs = [k for a in args for k in a.kinds], [n for a in args for n in a.outs]
    weights = [t for a in args for product in a.tensors for t in product]
    eps, heads, scale = args[0].norms[2], args[0].heads, args[0].scale

    def layers(x, cos, sin, mask, k_bufs, v_bufs, span, slot, positions, order, collect=()):
        return op(x, attention_norms, ffn_norms, eps, kinds, outs, weights, cos, sin, k_bufs, v_bufs, span, slot,
                  positions, mask, scale, order, *heads, list(collect))

    return layers


__all__ = ["DTYPES", "PANEL", "PanelLinear", "applies", "fused_layer", "fused_layers", "load", "pack_panels", "panels_apply", "use"]
