"""Shared fixtures: tiny float64 models for unit tests, the real default model for e2e."""

from __future__ import annotations

import ctypes
import gc
import os

# Tests never reach the network: a hub id that is not cached fails at once instead of retrying.
# Forced, not defaulted: HF_HUB_OFFLINE=0 in a developer's shell would otherwise make a test
# download (or hang retrying) and pass or fail with the network, not with the code.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# The CUDA kernels (Triton) run on CPU tensors under Triton's interpreter (tests/runner/test_cuda_kernels.py).
# Set before anything imports triton: its own library functions are decorated at import. On a GPU
# machine, TRITON_INTERPRET=0 runs them compiled.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter's tl.dot is numpy's matmul of the whole tile. A GPU's tile product computes a row
# the same way wherever it sits in the tile; OpenBLAS's AVX2 kernels (Haswell, Zen: an AVX2-only
# AMD EPYC) sum some rows of a 16-row tile in another order than row 0, so a kernel's rows would
# change with the rows beside them for a reason no GPU has. Its Sandybridge kernels do not (nor do
# its AVX-512 ones). Set before anything imports numpy: OpenBLAS reads it when it loads. Forced, not
# defaulted: a machine's environment may name the core itself (a 2-core Zen 5 EPYC set
# OPENBLAS_CORETYPE=Haswell, and four CUDA-kernel tests failed on rows the interpreter's dot had
# summed in another order).
os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest  # noqa: E402
import torch  # noqa: E402

from specdraft.testing import tiny_llama  # noqa: E402

# pytest-xdist runs a worker per core: each gets its share of the cores for torch's threads. With
# more OpenMP threads than cores, the workers' spin-waiting threads take the cores from each other
# (the suite took well over twice as long).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere): hands the heap's free pages back to the system."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


@pytest.fixture(autouse=True, scope="module")
def _return_freed_memory():
    """After each test module, what its decoders and models freed goes back to the system: glibc
    keeps freed heap pages resident otherwise (a worker that had run the e2e drafters held about
    twice what it used), and the suite's two workers and their subprocesses share this machine's
    24 GiB (issue 44: measured under 16 GiB)."""
    yield
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)


@pytest.fixture(scope="session")
def tiny_model():
    """Random 2-layer Llama, vocab 64, float64 (greedy ties cannot flip)."""
    return tiny_llama(vocab_size=64, seed=0)


@pytest.fixture(scope="session")
def small_vocab_model():
    """Random Llama with a 16-token vocabulary, for enumerating exact distributions."""
    model = tiny_llama(vocab_size=16, seed=1)
    with torch.no_grad():  # sharpen it a little so the distributions are not near-uniform
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture
def register_plugin():
    """Register a plugin object for one test; always unregistered afterwards."""
    from specdraft.plugins import pm

    registered = []

    def _register(plugin, name):
        pm.register(plugin, name=name)
        registered.append(plugin)
        return plugin

    try:
        yield _register
    finally:
        for plugin in registered:
            pm.unregister(plugin)


# -- the real default model (SmolLM2-135M-Instruct): loaded once per test process -----------------

from specdraft.models import load_target as real_load_target  # noqa: E402 (cached_default_model patches it)


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The default model's tokenizer alone (a real chat template), for tests with tiny models."""
    from transformers import AutoTokenizer

    from specdraft.models import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target(None)[1])


@pytest.fixture(scope="session")
def default_f64():
    """``(model, tokenizer)`` of the real default model in float64 (greedy ties cannot flip), loaded once."""
    model, tokenizer, _ = real_load_target(None, dtype=torch.float64)
    return model, tokenizer


@pytest.fixture(scope="session")
def default_f32():
    """``(model, tokenizer)`` of the real default model in float32, loaded once."""
    model, tokenizer, _ = real_load_target(None, dtype=torch.float32)
    return model, tokenizer


@pytest.fixture(scope="session")
def default_bf16():
    """``(model, tokenizer)`` of the real default model in bfloat16 (the CPU default where the processor
    multiplies bfloat16 natively), loaded once."""
    model, tokenizer, _ = real_load_target(None, dtype=torch.bfloat16)
    return model, tokenizer


@pytest.fixture
def cached_default_model(monkeypatch, request):
    """Paths that load the default model themselves (``specdraft.cli.main``, ``from_pretrained``)
    get the session's loaded copy (in float32, bfloat16 or float64, as asked or by default) instead of loading
    it again; any other target, dtype or device loads as usual. Loading the default model itself
    stays covered: the fixtures above call ``load_target``, and ``specdraft generate`` and
    ``specdraft serve`` run in fresh processes in tests/e2e/test_cli.py and
    tests/server/test_server_e2e.py."""
    import specdraft.models as models

    cached = {torch.float32: "default_f32", torch.float64: "default_f64", torch.bfloat16: "default_bf16"}

    def load(target=None, dtype=None, device=None, require_tokenizer=True, option="--target"):
        if target is None:
            wanted = models.resolve_dtype(dtype, models.resolve_device(device))
            if wanted in cached:
                model, tokenizer = request.getfixturevalue(cached[wanted])
                if model.device == models.resolve_device(device):
                    return model, tokenizer, models.DEFAULT_TARGET
        return real_load_target(target, dtype=dtype, device=device, require_tokenizer=require_tokenizer,
                                option=option)

    monkeypatch.setattr(models, "load_target", load)
    return load


@pytest.fixture(autouse=True)
def closing_decoders(monkeypatch):
    """Every SpeculativeDecoder made during a test and still alive after it is closed then, so
    its KV cache and drafter go at once (a sampled test's 512-row cache is about 100 MB). Held by
    weak reference: the test of a dropped decoder being freed must not be defeated by this."""
    import weakref

    from specdraft import SpeculativeDecoder

    made, init = [], SpeculativeDecoder.__init__

    def recording_init(self, *args, **kwargs):
        made.append(weakref.ref(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "__init__", recording_init)
    yield
    for ref in made:
        decoder = ref()
        if decoder is not None and hasattr(decoder, "_loop"):  # __init__ finished
            decoder.close()


class StepClock:
    """Stands in for the engine's ``time`` module: every ``perf_counter()`` reading is 1 ms after
    the last, so every verify pass costs the same whatever its width and however busy the
    machine is, and the adaptive policy's choices are the same on every run."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1e-3
        return self.now


@pytest.fixture
def step_clock(monkeypatch):
    """The engine reads a :class:`StepClock` for the test's duration."""
    from specdraft.engine import engine

    clock = StepClock()
    monkeypatch.setattr(engine, "time", clock)
    return clock
