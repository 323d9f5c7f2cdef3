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

import torch

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
#: the compiler's flags: the machine's own vector units, and OpenMP, without which ``at::parallel_for``
#: in the extension runs on one thread
FLAGS = ["-O3", "-march=native", "-fopenmp"]
#: dtypes the operators serve
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def load() -> str:
    """Build (once per machine and source) and load the extension; ``""`` when its operators are
    registered, else why not (no compiler, a build error, ``SPECDRAFT_CPU_OPS=torch``)."""
    if os.environ.get("SPECDRAFT_CPU_OPS", "").lower() == "torch":
        return "SPECDRAFT_CPU_OPS=torch"
    if hasattr(torch.ops, "specdraft_cpu") and hasattr(torch.ops.specdraft_cpu, "attention"):
        return ""
    from ..models import cache_dir

    scripts = os.path.dirname(sys.executable)  # the environment's ninja (a dependency), unactivated too
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension

    first = ""
    for flags in (FLAGS, [f for f in FLAGS if f != "-fopenmp"]):  # a compiler without OpenMP: one thread, still built
        digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()
        build = cache_dir() / "cpu-ops" / digest[:12]
        build.mkdir(parents=True, exist_ok=True)
        try:
            cpp_extension.load(name="specdraft_cpu_ops", sources=[str(SOURCE)], build_directory=str(build),
                               extra_cflags=flags, extra_ldflags=[f for f in flags if f == "-fopenmp"],
                               is_python_module=False, verbose=False)
            break
        except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a build error: torch's operators serve
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            first = first or next((line for line in lines if "error" in line.lower()
                                   and "building extension" not in line), lines[0])
    else:
        return f"the C++ extension did not build ({first.strip()[:200]}); torch's operators run instead"
    _register_fakes()
    return ""


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
    ``{"cpu_ops": "yes"}`` or ``{"cpu_ops": reason}`` for ``runner.info["kernels"]``."""
    reason = applies(model)
    if reason:
        return {"cpu_ops": reason}
    from .model import DECODE_WIDTH, LeanOps, RMSNorm, use_lean

    ops = torch.ops.specdraft_cpu
    use_lean(model, LeanOps(ops.rms_norm, ops.add_rms_norm, ops.rope_write, ops.attention, ops.silu_mul, DECODE_WIDTH))
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.kernel is None:
            module.kernel = ops.rms_norm
    return {"cpu_ops": "yes"}


__all__ = ["DTYPES", "applies", "load", "use"]
