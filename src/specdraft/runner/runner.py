"""The model runner: one model's forward over its own KV cache, eager, compiled or CUDA-graphed.

    runner = load_runner(hf_model, compile=False, quantize=None)   # ours, or transformers' as a fallback
    runner.cache.reset(rows=2, max_len=512)                         # empty cache for 2 sequences
    logits, hidden = runner.forward(tokens)                         # tokens [2, W] -> logits [2, W, vocab]
    runner.cache.set_lengths([40, 37])                              # rollback: write the lengths

A pass may run a subset of the cache's rows (``slots``, a long tensor of row indices): a
continuous-batching engine gives each sequence a row (a slot) for its lifetime and runs the
slots of the running sequences only; ``cache.set_lengths(..., slots=)`` writes those rows' lengths.

Every row of a pass has ``W`` tokens (right-pad shorter rows and pass ``advance``, each row's own
count: the padding is written past the row's length, so it is never attended to and the next
pass overwrites it). The lengths live on the device (:attr:`lengths`); nothing that changes per
step reaches the model as a Python int. The cache is a :class:`~specdraft.cache.StaticCache`
(``runner.cache``): the runner reads and writes it, its callers size it and roll it back.

With ``compile=True`` a pass of width ``W`` runs at the next width bucket (:data:`WIDTH_BUCKETS`)
through one compiled graph per bucket that every decoder layer shares (compiled once per bucket:
seconds, and reused across runs through torch's compile cache); wider passes (prefill) run
eagerly. On CUDA each (rows, width bucket) pass is also captured as a CUDA graph on first use and
replayed after that, as nano-vllm's model runner does. Padding is never accepted: its logits are
cut off before they are returned.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import torch

from .base import RunnerBase, attention_backends
from ..cache import StaticCache
from ..cache.static import as_long
from .convert import from_transformers
from .kernels import pack_linears
from .model import SpecdraftModel, run_block

#: Pass widths a compiled runner pads to (a verify pass is K+1 <= 17 tokens; trees go wider).
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32)


def width_bucket(width: int, buckets: tuple[int, ...] = WIDTH_BUCKETS) -> int | None:
    """The smallest of ``buckets`` holding ``width`` tokens, or None past the largest (run eagerly)."""
    return next((b for b in buckets if b >= width), None)


def runner_buckets(model) -> tuple[int, ...]:
    """A compiled runner's width buckets: :data:`WIDTH_BUCKETS`, and on CUDA with the invariant
    kernels one more at :data:`~.model.CUDA_DECODE_WIDTH` (64): a pass wider than the last bucket
    runs eagerly, whose elementwise operations round otherwise than the compiled graphs' fused
    ones, so its tokens would differ from compiled one-token steps (seen on an H100 at 48 and 64)."""
    from .model import CUDA_DECODE_WIDTH

    kernels = getattr(model, "kernels", None)
    if isinstance(kernels, dict) and kernels.get("cuda") == "invariant":
        return WIDTH_BUCKETS + (CUDA_DECODE_WIDTH,)
    return WIDTH_BUCKETS


#: The shortest span a pass attends over; spans are powers of two from here to the capacity.
MIN_SPAN = 64


def span_for(bound: int, capacity: int) -> int:
    """Positions a pass attends over when no row will hold more than ``bound`` after it: the next
    power of two (at least :data:`MIN_SPAN`), so attention reads what is stored, not the whole buffer."""
    span = MIN_SPAN
    while span < bound:
        span *= 2
    return min(span, capacity)


class ModelRunner(RunnerBase):
    """specdraft's own model (:class:`SpecdraftModel`) over a :class:`~specdraft.cache.StaticCache`."""

    implementation = "specdraft"

    def __init__(self, model: SpecdraftModel, compile: bool = False, quantization: str | None = None) -> None:
        self.model = model
        self.compiled = bool(compile)
        self.quantization = quantization
        #: the static KV cache the passes run over (:mod:`specdraft.cache`): the engine and the
        #: drafters size it, roll it back and keep tree paths through it
        #: the widths passes are padded to when compiled (:func:`runner_buckets`)
        self.buckets = runner_buckets(model)
        self.cache = StaticCache(model.new_cache, headroom=self.buckets[-1])
        self._epoch = 0
        self.compile_seconds = 0.0  # spent compiling (first passes of each bucket)
        self._compiled_block = None
        self._graphs: dict[tuple, tuple[Any, ...]] = {}  # CUDA graphs per (rows, width, logits_at, hidden)
        if self.compiled:
            import torch._dynamo

            compiled = torch.compile(run_block, fullgraph=True, dynamic=False)

            def block(layer, x, cos, sin, mask, keys, values, slot, positions, gather, order=None):
                _raise_recompile_limits()
                # one graph for every span and every batch of two or more rows (continuous batching
                # changes the batch every few steps): those dimensions are symbolic, the rest static
                spans = ((mask, 3), (keys, 2), (values, 2)) + (() if order is None else ((order, 2),))
                for t, dim in spans:
                    torch._dynamo.mark_dynamic(t, dim)
                if x.shape[0] > 1:  # keys and values have the batch's rows, or (gather) every slot
                    batch = (x, cos, sin, mask, slot, positions) + (() if order is None else (order,))
                    for t in batch + (() if gather else (keys, values)):
                        torch._dynamo.maybe_mark_dynamic(t, 0)
                if gather:  # every slot: the cache's rows follow the sequences running (engine.memory)
                    torch._dynamo.maybe_mark_dynamic(keys, 0)
                    torch._dynamo.maybe_mark_dynamic(values, 0)
                return compiled(layer, x, cos, sin, mask, keys, values, slot, positions, gather, order)

            self._compiled_block = block
        #: what runs each decoder block of a bucketed pass: fixed when the runner is built (wider passes run eagerly)
        self._block_fn = self._compiled_block or run_block
        self._seen: set[tuple] = set()

    @property
    def info(self) -> dict:
        """:class:`RunnerBase`'s, with ``kernels``: which kernels the passes run and why (the
        load-time checks' report: :func:`~.kernels.pack_linears` on CPU,
        :func:`~.cuda_kernels.make_invariant` on CUDA)."""
        return dict(super().info, kernels=self.model.kernels)

    @property
    def cuda_graphs(self) -> bool:
        return self.compiled and self.device.type == "cuda"

    # -- the cache -----------------------------------------------------------------------

    def _check_epoch(self) -> None:
        """CUDA graphs hold the cache's buffers: made again after the cache reallocates."""
        if self._epoch != self.cache.epoch:
            self._graphs.clear()
            self._epoch = self.cache.epoch

    def warm_up(self, rows: int, widths) -> None:
        """Compile every width bucket that passes of ``widths`` tokens use (rows ``rows``); the cache is emptied."""
        if not self.compiled:
            return
        self.cache.reset(rows, MIN_SPAN)
        with torch.inference_mode():
            for bucket in sorted({width_bucket(w, self.buckets) for w in widths} - {None}):
                for hidden in self._warm_variants(bucket):
                    self._forward(self._blank(rows, bucket), None, hidden, None, None)
                    self.cache.set_lengths([0] * rows)

    def _warm_variants(self, bucket: int) -> tuple[bool, ...]:
        """The ``hidden`` settings a pass of ``bucket`` tokens is compiled for."""
        return (False, True) if bucket > 1 else (False,)

    def _blank(self, rows: int, width: int) -> torch.Tensor:
        """Inputs of a pass of ``rows x width`` (what warm-up runs): token ids."""
        return torch.zeros((rows, width), dtype=torch.long, device=self.device)

    # -- the forward ---------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, logits_at: torch.Tensor | None = None, hidden: bool = False,
                advance=None, slots=None, tree_mask: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, then=None) -> tuple[torch.Tensor, ...]:
        """Run ``tokens # [rows, W]`` (long, on the device) after each row's stored tokens.

        Returns ``(logits, hidden)``: logits ``[rows, W, vocab]``, or ``[rows, N, vocab]`` at the
        indices ``logits_at # [rows, N]`` into ``0..W-1``; with ``hidden``, the final-norm hidden
        states ``[rows, W, dim]`` (else None), or with ``hidden=(i, j, ...)`` the states entering
        those layers side by side, ``[rows, W, n * dim]``, from the same pass. Each row's length grows by ``W``, or by
        ``advance[b]`` (a list or long tensor ``[rows]``) when rows carry padding.
        ``slots`` (a list of distinct row indices, one per row of ``tokens``): the cache rows the
        pass runs on (default: every row, in order).
        ``tree_mask # [B, W, P]`` bool and ``depths # [B, W]`` long: a tree of tokens (see
        :meth:`SpecdraftModel.forward <specdraft.runner.model.SpecdraftModel.forward>`).

        ``then=(fn, tensors, name)``: returns ``fn(logits, hidden, *tensors)`` instead (a tuple of
        tensors), computed in the pass's CUDA graph where it has one (captured per ``name`` and
        width, the ``tensors`` copied in like the inputs): what the caller does with the logits
        at once, e.g. greedy acceptance, with no kernel launched after the graph. ``fn`` must
        not read the device nor make tensors from host data.
        """
        tree = None if tree_mask is None else (tree_mask, depths)
        with attention_backends(tokens.device):
            return self._forward(tokens, logits_at, hidden, advance, self._slots(slots, tokens.shape[0]), tree, then)

    #: :meth:`forward` takes ``then``
    passes_then = True

    #: passes may carry a tree mask (:meth:`forward`)
    supports_tree = True

    def _slots(self, slots, rows: int) -> list[int] | None:
        """``slots`` as a list, or None when they are every row of the cache in order (no gather)."""
        if slots is None:
            return None
        slots = [int(s) for s in slots]
        if len(slots) != rows:
            raise ValueError(f"{len(slots)} slots for a pass of {rows} rows")
        return None if slots == list(range(self.cache.kv.slots)) else slots

    def _forward(self, inputs, logits_at, hidden, advance, slots, tree=None, then=None):
        """A pass of ``inputs # [rows, W, ...]`` (token ids, or hidden states for a :class:`LayerRunner`): the
        span it attends over, the width bucket and its padding, and the compiled or CUDA-graphed call
        (and ``then``, :meth:`forward`'s)."""
        rows, width = inputs.shape[:2]
        if advance is not None:
            advance = as_long(advance, inputs.device)
        bucket = width_bucket(width, self.buckets) if self.compiled else None
        bound = self.cache.grow(slots, width)
        span = span_for(bound + (bucket or width), self.cache.kv.max_len)
        cache, rows_t, first = self._rows_of(slots, inputs.device)
        if bucket is None:  # eager: any width
            out = self._run(inputs, cache, rows_t, logits_at, hidden, advance, span, tree, run_block)
            return out if then is None else then[0](*out, *then[1])
        if bucket > width:  # pad; the padding's keys land past each row's new length
            inputs = torch.cat([inputs, inputs.new_zeros((rows, bucket - width) + tuple(inputs.shape[2:]))], dim=1)
            if advance is None:
                advance = torch.full((rows,), width, dtype=torch.long, device=inputs.device)
            tree = pad_tree(tree, bucket - width)
        key = (rows, bucket, span, None if logits_at is None else tuple(logits_at.shape), hidden, advance is None,
               rows_t is None, first, None if tree is None else tree[0].shape[-1])
        start = time.perf_counter() if key not in self._seen else None

        def finish(logits, states, then=then):  # the padding cut off, then ``then``
            if logits_at is None and bucket > width:
                logits = logits[:, :width]
            if states is not None and bucket > width:
                states = states[:, :width]
            return (logits, states) if then is None else then[0](logits, states, *then[1])

        if self.cuda_graphs:  # ``then`` in the graph (captured per width: it reads the cut), the cut after it
            key += () if then is None else (then[2], width)
            out = self._replay(key, inputs, logits_at, hidden, advance, span, rows_t, cache, tree, then, finish)
            if then is None:
                out = finish(*out)
        else:
            out = finish(*self._run(inputs, cache, rows_t, logits_at, hidden, advance, span, tree, self._block_fn))
        if start is not None:
            self._seen.add(key)
            self.compile_seconds += time.perf_counter() - start
        return out

    def _rows_of(self, slots: list[int] | None, device):
        """The cache a pass on ``slots`` runs over: ``(cache, rows # [rows] long | None, first)``; a
        run of consecutive slots is a view of the cache (``first``: its first row), with no gather."""
        cache, first = self.cache.kv, None
        if slots is not None and slots == list(range(slots[0], slots[0] + len(slots))):
            cache, first, slots = cache.narrow(slots[0], len(slots)), slots[0], None
        return cache, None if slots is None else as_long(slots, device), first

    def loop(self, fn, inputs: tuple[torch.Tensor, ...], steps: int, slots=None, key=()):
        """``fn(*inputs, step)``, whose ``step(x # [rows, 1, ...], hidden=False)`` is a one-position
        pass (the forward's ``(logits or output, hidden states or None)``) and which makes at most ``steps`` of them:
        a drafter's whole chain, its heads and choices included, with no host work between steps.

        On CUDA with graphs (:attr:`cuda_graphs`) ``fn`` is captured as one CUDA graph per ``key``
        (what ``fn`` is: it must not read the device, nor make tensors from host data), batch and
        span, and replayed on copies of ``inputs``; its outputs are returned as new tensors. Elsewhere
        it runs as it is. Every pass attends over the span of the last one, and each slot's bound
        grows by ``steps`` whether or not ``fn`` makes them all (the rows' lengths are the device's).
        """
        rows = inputs[0].shape[0]
        slots = self._slots(slots, rows)
        bound = self.cache.grow(slots, steps)
        span = span_for(bound + steps, self.cache.kv.max_len)
        cache, rows_t, first = self._rows_of(slots, inputs[0].device)
        with attention_backends(inputs[0].device):
            if not self.cuda_graphs:
                return fn(*inputs, self._stepper(cache, rows_t, span))
            self._check_epoch()
            key = ("loop", key, rows, steps, span, first, rows_t is None)
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = self._capture_loop(fn, inputs, cache, rows_t, span)
            cuda_graph, static_in, static_out = graph
            for buf, value in zip(static_in, inputs + (rows_t,)):
                if buf is not None:
                    buf.copy_(value)
            cuda_graph.replay()
            return tuple(t.clone() for t in static_out)

    def _stepper(self, cache, rows, span):
        def step(x, hidden=False):
            return self._run(x, cache, rows, None, hidden, None, span, None, self._block_fn)
        return step

    def _capture_loop(self, fn, inputs, cache, rows, span):
        static_in = tuple(None if t is None else t.clone() for t in inputs + (rows,))
        step = self._stepper(cache, static_in[-1], span)
        cuda_graph, static_out = self._graph_of(lambda: fn(*static_in[:-1], step))
        return cuda_graph, static_in, static_out

    def _run(self, inputs, cache, rows, logits_at, hidden, advance, span, tree, block_fn):
        """The model's forward over ``cache``: ``(logits, hidden states or None)``."""
        out = self.model(inputs, cache, rows=rows, logits_at=logits_at, return_hidden=hidden, advance=advance,
                         span=span, block_fn=block_fn, **_tree_kwargs(tree))
        return out.logits, out.hidden

    def _replay(self, key, inputs, logits_at, hidden, advance, span, rows, cache, tree, then, finish):
        """The pass as a CUDA graph, with ``finish`` (the padding cut and ``then``) when there is a
        ``then``: captured on first use of ``key``, replayed on static buffers; its outputs are
        returned as new tensors."""
        self._check_epoch()
        extras = () if then is None else tuple(then[1])
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(inputs, logits_at, hidden, advance, span, rows, cache, tree, then, finish)
            self._graphs[key] = graph
        cuda_graph, static_in, static_out = graph
        for buf, value in zip(static_in, (inputs, logits_at, advance, rows) + (tree or (None, None)) + extras):
            if buf is not None:
                buf.copy_(value)
        cuda_graph.replay()
        return tuple(None if t is None else t.clone() for t in static_out)

    def _capture(self, inputs, logits_at, hidden, advance, span, rows, cache, tree, then, finish):
        extras = () if then is None else tuple(then[1])
        static_in = tuple(None if t is None else t.clone()
                          for t in (inputs, logits_at, advance, rows) + (tree or (None, None)) + extras)
        static_tree = None if tree is None else static_in[4:6]
        static_then = None if then is None else (then[0], static_in[6:], then[2])  # on the static copies

        def run():
            out = self._run(static_in[0], cache, static_in[3], static_in[1], hidden, static_in[2], span,
                            static_tree, self._block_fn)
            return out if then is None else finish(*out, then=static_then)

        cuda_graph, static_out = self._graph_of(run)
        return cuda_graph, static_in, static_out

    def _graph_of(self, run):
        """``run()`` (passes over the cache) captured as a CUDA graph, after two warm-up runs on a
        side stream (they compile); the cache's lengths are as they were before: the replays advance
        them. Returns ``(graph, run's outputs)``, the outputs being the graph's static buffers."""
        saved = self.cache.lengths.clone()  # [rows]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
            for _ in range(2):
                self.cache.lengths.copy_(saved)
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.cache.lengths.copy_(saved)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            static_out = run()
        self.cache.lengths.copy_(saved)  # the capture did not run the passes; the replays will
        return cuda_graph, static_out


def _tree_kwargs(tree) -> dict:
    return {} if tree is None else {"tree_mask": tree[0], "depths": tree[1]}


def pad_tree(tree, extra: int):
    """``(tree_mask # [B, W, P], depths # [B, W])`` with ``extra`` padding tokens after the pass:
    they see only what precedes the tree and themselves, and no real token sees them."""
    if tree is None or extra <= 0:
        return tree
    mask, depths = tree
    rows, width, span = mask.shape
    padded = mask.new_zeros((rows, width + extra, span + extra))
    padded[:, :width, :span] = mask
    more = depths[:, -1:] + torch.arange(1, extra + 1, device=depths.device)
    return padded, torch.cat([depths, more], dim=1)


_THREAD = threading.local()


def _raise_recompile_limits() -> None:
    """Room for a graph per width bucket and batch kind (one row, a subset of the slots, all of
    them), shared by every runner in the process: the default limit of 8 would fail (fullgraph).
    Dynamo's settings are per thread, and passes run on the engine's thread: set them there."""
    if not getattr(_THREAD, "limits", False):
        config = torch._dynamo.config
        config.cache_size_limit = max(config.cache_size_limit, 256)
        config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 1024)
        _THREAD.limits = True


def _version(tensor: torch.Tensor) -> int | None:
    """How often ``tensor`` was changed in place (None for an inference tensor, which has no counter)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


#: weight quantizations a runner offers (None: the model's own weights)
QUANTIZATIONS = (None, "int8", "int4", "gguf")

#: quantizations whose kernels are CPU ones, and why
CPU_ONLY = {"int4": "torch's int4 kernel here is the CPU one", "gguf": "the blocks' kernel is a CPU one"}

#: converted (and quantized) models per transformers model: runners of one model share its weights
_CONVERTED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def default_compile(device) -> bool:
    """Whether a model on ``device`` is compiled when the caller does not say: on CUDA yes, on CPU no.

    CPU: measured (docs/benchmarks.md): compiling made the float32 step slower and costs tens of
    seconds up front; it pays with ``quantize="int4"``/``"int8"``, so ask for it there. The CPU
    step's glue is already one C++ operator per stage (:mod:`.cpu_ops`).
    CUDA: CUDA graphs, measured on an NVIDIA H100 (docs/benchmarks.md, 2026-11-26): a Llama-3.2-3B
    shaped decode step 5.2 ms with graphs against 25.7 ms eager (its weight-read floor 2.2 ms),
    Spec-Bench on the default model with 0 mismatches for every drafter, graphs and eager alike;
    capture costs 35-45 s when the model loads. ``compile=False`` (``--no-compile``) keeps eager.
    """
    return torch.device(device).type == "cuda"


def load_runner(hf_model, compile: bool = False, quantize: str | None = None):
    """A runner for a loaded transformers model: specdraft's own model code when it reproduces the
    architecture, else :class:`TransformersRunner` (eager; ``fallback_reason`` says why).

    ``quantize`` (ours only): ``"int8"`` makes every linear layer, the LM head included, weight-only
    int8 with a scale per output channel; ``"int4"`` 4-bit with a scale and zero point per group of
    32 inputs (CPU only). Their products run in bfloat16 (the only vectorised kernels on x86 CPUs;
    a float64 model keeps float64 products for the parity tests). See :mod:`.quantize`.
    """
    from ..errors import ConfigError

    check_quantize(quantize, hf_model.device)
    # reuse a conversion only while the source weights are the very same, unchanged tensors
    state = tuple((p.data_ptr(), _version(p)) for p in hf_model.parameters())
    converted = _CONVERTED.get(hf_model)
    if converted is None or converted.get("state") != state:
        converted = _CONVERTED[hf_model] = {"state": state}
    if quantize in converted:
        return ModelRunner(converted[quantize], compile=compile, quantization=quantize)
    model, reason = from_transformers(hf_model)
    if model is None:
        if compile or quantize:
            wanted = " and ".join(x for x in ("compile" if compile else "", f"quantize={quantize!r}" if quantize else "")
                                  if x)
            raise ConfigError(f"{wanted} needs specdraft's own model code, which this model cannot use: {reason}")
        from .hf import TransformersRunner

        return TransformersRunner(hf_model, reason)
    folder = getattr(hf_model, "name_or_path", "") or ""  # where quantize="gguf" finds the file's blocks
    converted[quantize] = finish_model(model, quantize, folder)
    return ModelRunner(model, compile=compile, quantization=quantize)


def check_quantize(quantize: str | None, device) -> None:
    """ConfigError unless ``quantize`` is one of :data:`QUANTIZATIONS` and runs on ``device``."""
    from ..errors import ConfigError

    if quantize not in QUANTIZATIONS:
        raise ConfigError(f"quantize must be one of {', '.join(map(repr, QUANTIZATIONS))} (got {quantize!r})")
    why = CPU_ONLY.get(quantize)
    if why and torch.device(device).type != "cpu":
        raise ConfigError(f"quantize={quantize!r} runs on CPU only ({why}); use quantize='int8' on a GPU")


def finish_model(model: SpecdraftModel, quantize: str | None, folder: str = "") -> SpecdraftModel:
    """``model`` (converted, or one rank's shard of it) quantized as :func:`load_runner` says and its
    float linear layers packed (:mod:`.kernels`), in place; ``folder``: the converted GGUF folder
    whose file's blocks ``quantize="gguf"`` runs (:mod:`.gguf_blocks`)."""
    blocks = {}
    if quantize == "gguf":
        from ..errors import ConfigError
        from . import cpu_ops
        from .gguf_blocks import use_blocks

        reason = cpu_ops.load()
        if reason:
            raise ConfigError(f"quantize='gguf' needs specdraft's C++ operators: {reason}")
        blocks = use_blocks(model, folder)
    elif quantize is not None:
        from .quantize import quantize_int4, quantize_int8

        if model.dtype == torch.float32:
            # the low-bit kernels are vectorised in bfloat16 only (see .quantize); a float64 model keeps
            # float64 products for the parity tests
            model.to_dtype(torch.bfloat16)
        if quantize == "int8":  # a float64 model (the parity tests) multiplies dequantized weights in float64
            quantize_int8(model, compute_dtype=None if model.dtype == torch.float64 else torch.bfloat16)
        else:
            quantize_int4(model, group_size=32)  # float64 inputs take the dequantized weights in float64
    model.kernels = blocks | pack_linears(model)  # float linears that are left: oneDNN, row-invariant (see .kernels)
    if model.device.type == "cpu" and model.dtype != torch.float64:  # the layers' glue and attention (see .cpu_ops)
        from . import cpu_ops

        model.kernels.update(cpu_ops.use(model))
    if model.device.type == "cuda":  # Triton or checked cuBLAS, row-invariant (see .cuda_kernels)
        from .cuda_kernels import make_invariant
        from .model import CUDA_DECODE_WIDTH

        model.kernels = make_invariant(model, CUDA_DECODE_WIDTH)
    return model
