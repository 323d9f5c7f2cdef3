"""The decoder layer's C++ operators on CPU (specdraft.runner.cpu_ops): each against torch in float64,
each row-invariant (a row's bits do not depend on the other rows of a call, a pass's width or a
masked tail), and a layer of at most 12 operators that do work (the count a decode step dispatches).

Row invariance of whole models on these operators (every architecture, float32 and bfloat16, eager,
compiled and trees) is tests/runner/test_row_invariance.py's; greedy parity of speculation is the
verifier's and the engine's tests'."""

from __future__ import annotations

import collections
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from specdraft.runner import cpu_ops, load_runner
from specdraft.runner.model import rms_norm as torch_rms_norm
from specdraft.testing import differing_widths, on_one_thread
from specdraft.testing.architectures import tiny_config, tiny_hf

pytestmark = pytest.mark.skipif(cpu_ops.load() != "", reason=f"no C++ extension here: {cpu_ops.load()}")
ops = torch.ops.specdraft_cpu
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: closeness to float64 per dtype (one rounding of the output, and float32 arithmetic before it)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _close(got, want, dtype):
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want.double(), atol=TOL[dtype] * max(1.0, want.abs().max().item()),
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_silu_mul_equal_torch_and_each_row_alone(dtype):
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(3, 5, 96, generator=gen).to(dtype) for _ in range(2))
    weight = torch.rand(96, generator=gen).to(dtype) + 0.5
    normed = ops.rms_norm(x, weight, 1e-5)
    _close(normed, torch_rms_norm(x.double(), weight.double(), 1e-5), dtype)
    total, total_normed = ops.add_rms_norm(x, y, weight, 1e-5)
    assert torch.equal(total, x + y)  # one rounding of the exact sum, as torch's add
    assert torch.equal(total_normed, ops.rms_norm(total, weight, 1e-5))
    g = torch.randn(3, 5, 2 * 48, generator=gen).to(dtype)
    gate, up = g.double().chunk(2, dim=-1)
    _close(ops.silu_mul(g), F.silu(gate) * up, dtype)
    for out, fn in ((normed, lambda rows: ops.rms_norm(rows, weight, 1e-5)), (ops.silu_mul(g), ops.silu_mul)):
        source = x if out is normed else g
        flat = source.reshape(-1, source.shape[-1])
        alone = torch.cat([fn(flat[i:i + 1]) for i in range(flat.shape[0])])
        assert torch.equal(out.reshape(alone.shape), alone)


def _attention_inputs(dtype, width, seed=0, slots=3, heads=6, kv_heads=2, dim=32, max_len=40):
    gen = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(slots, kv_heads, max_len, dim, generator=gen).to(dtype)
    v_buf = torch.randn(slots, kv_heads, max_len, dim, generator=gen).to(dtype)
    q = torch.randn(2, heads, width, dim, generator=gen).to(dtype)
    return q, k_buf, v_buf


def _causal(starts, width, span):
    cols = torch.arange(span)
    positions = torch.as_tensor(starts)[:, None] + torch.arange(width)
    return (cols[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, W, span]


#: (query heads, KV heads, head dim): each head group size the kernel specialises (1-4) and wider
#: ones (5, 6: the general path), head dims whole blocks of 64 lanes, not (the rest of 80 columns
#: after a block, 32 without one), and not of 16
GROUPS = [(6, 2, 32), (4, 4, 64), (4, 2, 80), (12, 3, 64), (6, 1, 20), (12, 2, 64), (5, 1, 80), (10, 2, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", GROUPS)
def test_attention_equals_sdpa_over_the_rows_slots(dtype, heads, kv_heads, dim):
    q, k_buf, v_buf = _attention_inputs(dtype, width=4, heads=heads, kv_heads=kv_heads, dim=dim)
    slot, starts = torch.tensor([2, 0]), [9, 21]
    mask = _causal(starts, 4, 40)
    got = ops.attention(q, k_buf, v_buf, slot, mask, 0.2, None)  # [B, W, heads * dim]
    want = F.scaled_dot_product_attention(q.double(), k_buf[slot].double(), v_buf[slot].double(), attn_mask=mask,
                                          scale=0.2, enable_gqa=True)
    _close(got, want.transpose(1, 2).reshape(2, 4, -1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [GROUPS[0], GROUPS[3], GROUPS[5]])
def test_attention_of_a_token_is_the_same_in_any_pass(dtype, heads, kv_heads, dim):
    """Token t of a W-token pass, over a span with a masked tail, equals its one-token step over a
    shorter span: bit for bit, for W in 1..16."""
    q, k_buf, v_buf = _attention_inputs(dtype, width=16, seed=1, heads=heads, kv_heads=kv_heads, dim=dim)
    slot, starts = torch.tensor([1, 2]), torch.tensor([5, 17])
    for width in range(1, 17):
        wide = ops.attention(q[:, :, :width], k_buf, v_buf, slot, _causal(starts, width, 40), 0.2, None)
        for t in range(width):
            one = ops.attention(q[:, :, t:t + 1].contiguous(), k_buf[:, :, :34], v_buf[:, :, :34], slot,
                                _causal(starts + t, 1, 34), 0.2, None)
            assert torch.equal(wide[:, t], one[:, 0]), (width, t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", GROUPS)
def test_a_heads_attention_is_the_same_alone(dtype, heads, kv_heads, dim):
    """The query heads sharing a KV head are computed together; each one's result is bit for bit
    what it is computed alone (one head over its KV head), in a tree pass's order too."""
    q, k_buf, v_buf = _attention_inputs(dtype, width=3, seed=3, heads=heads, kv_heads=kv_heads, dim=dim)
    slot, starts = torch.tensor([2, 0]), torch.tensor([9, 21])
    mask = _causal(starts, 3, 40).clone()
    mask[..., 4] = False  # a hole
    order = torch.argsort(torch.rand(2, 3, 40, generator=torch.Generator().manual_seed(4)), dim=-1)
    group = heads // kv_heads
    for tree in (None, order):
        together = ops.attention(q, k_buf, v_buf, slot, mask, 0.2, tree).view(2, 3, heads, dim)
        for h in range(heads):
            kv = slice(h // group, h // group + 1)
            alone = ops.attention(q[:, h:h + 1].contiguous(), k_buf[:, kv].contiguous(), v_buf[:, kv].contiguous(),
                                  slot, mask, 0.2, tree)
            assert torch.equal(together[:, :, h], alone), (h, tree is not None)


def test_attention_follows_a_tree_order():
    """With ``order``, a token meets its visible positions in that order: a tree token whose
    ancestors sit apart equals a one-token step where they are consecutive (its path's layout)."""
    q, k_buf, v_buf = _attention_inputs(torch.bfloat16, width=1, seed=2)
    q = q[:1]
    slot = torch.tensor([0])
    # the tree token sees 0..9 and positions 12, 15 (its ancestors) and 17 (itself)
    seen = torch.zeros(1, 1, 1, 40, dtype=torch.bool)
    seen[..., :10] = True
    seen[..., [12, 15, 17]] = True
    order = torch.sort((~seen[:, 0]).to(torch.uint8), dim=-1, stable=True).indices  # visible first, in order
    tree = ops.attention(q, k_buf, v_buf, slot, seen, 0.2, order)
    path_k, path_v = k_buf.clone(), v_buf.clone()  # the path's one-token layout: 0..9, then 10, 11, 12
    path_k[:, :, 10:13], path_v[:, :, 10:13] = k_buf[:, :, [12, 15, 17]], v_buf[:, :, [12, 15, 17]]
    one = ops.attention(q, path_k, path_v, slot, _causal([12], 1, 40), 0.2, None)
    assert torch.equal(tree, one)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_rotates_and_writes_the_cache(dtype):
    heads, kv_heads, dim, width = 4, 2, 16, 3
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, width, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.tensor([[4, 5, 6], [0, 1, 2]])
    freqs = positions[..., None].float() * (1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    k_buf, v_buf = torch.zeros(3, kv_heads, 8, dim, dtype=dtype), torch.zeros(3, kv_heads, 8, dim, dtype=dtype)
    slot = torch.tensor([2, 0])
    q = ops.rope_write(qkv, cos, sin, k_buf, v_buf, slot, positions, heads, kv_heads)
    qq, kk, vv = qkv.double().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)

    def rotate(t, n):  # transformers' rotation, [B, W, n * dim] -> [B, n, W, dim]
        t = t.view(2, width, n, dim).transpose(1, 2)
        half = torch.cat((-t[..., dim // 2:], t[..., :dim // 2]), dim=-1)
        return t * cos.double() + half * sin.double()

    _close(q, rotate(qq, heads), dtype)
    k, v = rotate(kk, kv_heads), vv.view(2, width, kv_heads, dim).transpose(1, 2)
    for b, s in enumerate(slot.tolist()):
        _close(k_buf[s][:, positions[b]], k[b], dtype)
        assert torch.equal(v_buf[s][:, positions[b]], v[b].to(dtype))
    assert not k_buf[1].any() and not v_buf[1].any()  # the slot no row uses is untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_of_a_wide_pass_is_each_token_alone(dtype):
    """A pass of 2 x 12 tokens (spread over threads) rotates and writes each token as its own
    one-token call does, bit for bit; tables given in float32 (the dtype's values widened) too."""
    heads, kv_heads, dim, width = 6, 2, 32, 12
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, width, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    cos, sin = (torch.randn(2, 1, width, dim, generator=gen).to(dtype) for _ in range(2))
    positions = torch.stack([torch.arange(3, 3 + width), torch.arange(20, 20 + width)])
    slot = torch.tensor([1, 0])
    bufs = [torch.zeros(2, kv_heads, 40, dim, dtype=dtype) for _ in range(6)]
    q = ops.rope_write(qkv, cos, sin, bufs[0], bufs[1], slot, positions, heads, kv_heads)
    q32 = ops.rope_write(qkv, cos.float(), sin.float(), bufs[2], bufs[3], slot, positions, heads, kv_heads)
    assert torch.equal(q, q32) and torch.equal(bufs[0], bufs[2]) and torch.equal(bufs[1], bufs[3])
    for b in range(2):
        for w in range(width):
            one = ops.rope_write(qkv[b:b + 1, w:w + 1], cos[b:b + 1, :, w:w + 1], sin[b:b + 1, :, w:w + 1], bufs[4],
                                 bufs[5], slot[b:b + 1], positions[b:b + 1, w:w + 1], heads, kv_heads)
            assert torch.equal(one[0, :, 0], q[b, :, w])
    assert torch.equal(bufs[4], bufs[0]) and torch.equal(bufs[5], bufs[1])
    assert bufs[0].any()


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_pass_tables_are_what_run_blocks_computes_in_torch(dtype, window):
    """One call's positions, mask and rotary rows equal pass_positions', attention_mask's and
    rope_lookup's, bit for bit: ragged starts, widths 1 to 5, a span past the pass's end."""
    from specdraft.cache.static import attention_mask, pass_positions
    from specdraft.runner.model import rope_lookup, rope_table

    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    starts = torch.tensor([0, 5, 17])
    for width in range(1, 6):
        span = 17 + width + 4
        table = rope_table(inv_freq, dtype, 64, starts.device)
        positions, mask, cos, sin = ops.pass_tables(starts, width, span, table, window)
        assert torch.equal(positions, pass_positions(starts, width))
        assert torch.equal(mask, attention_mask(starts, width, span, window=window))
        want_cos, want_sin = rope_lookup(inv_freq, positions, dtype, 64)
        assert cos.dtype == dtype and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.pass_tables(torch.tensor([63]), 2, 70, table, None)


def _sequential_products(x, weight, bias):
    """What ``specdraft_cpu::linear`` computes, one fused multiply-add at a time: per output, a float32
    sum over the inputs in order, each step rounded once (float32 products are exact in float64),
    then the bias, then one rounding to the dtype."""
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    xd, wd = x.double(), weight.double()
    for k in range(x.shape[1]):
        acc = (xd[:, k, None] * wd[None, :, k] + acc.double()).float()
    return (acc if bias is None else acc + bias.float()).to(x.dtype)


#: (inputs, outputs, bias): whole panels and a last partial one, odd widths, one output, and panels
#: in groups of four (from 64 panels on) with a last group of one
PANEL_SHAPES = [(96, 64, False), (37, 23, True), (64, 200, True), (5, 1, False), (24, 1030, True)]
#: row counts across its tiles (AVX-512: 12 x 2 panels, 6 x NB, a rest; AVX2: 1 x NB, 2 x 2, 6 x 1,
#: a rest) and its chunks of 96 rows
PANEL_ROWS = [1, 2, 3, 5, 6, 7, 11, 12, 13, 25, 97, 200]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs,outputs,bias", PANEL_SHAPES)
def test_panel_products_sum_each_output_in_order_whatever_the_rows(dtype, inputs, outputs, bias):
    """Bit for bit the sequential sum, at every row count: row-invariant by construction."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(inputs, outputs, bias=bias).to(dtype)
    panel = cpu_ops.PanelLinear(linear)
    assert panel.panels.shape == (-(-outputs // 16), inputs, 16)
    x = torch.randn(max(PANEL_ROWS), inputs).to(dtype)
    want = _sequential_products(x, linear.weight.detach(), linear.bias.detach() if bias else None)
    for rows in PANEL_ROWS:
        assert torch.equal(panel(x[:rows]), want[:rows]), rows
    assert torch.equal(panel(x[:6].view(2, 3, inputs)), want[:6].view(2, 3, outputs))  # leading dims kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_products_add_input_k_before_input_k_plus_one(dtype):
    """Each output adds its inputs' products in order even where a machine multiplies bfloat16 inputs
    in pairs (``avx512_bf16``): 1, then -1, then 2^-30 sums to 2^-30, where any other order loses it
    to rounding. (Random inputs cannot tell: a bfloat16 output rounds the float32 sums' differences
    away.) Inputs 2 and 3 share a pair, and so do 6 and 7, where the odd outputs then add 2, -2 and
    2^-29 (2 + 2^-30 rounds to 2, so in order the sum is 2^-29, and 0 in any other); 13 rows."""
    inputs, outputs, rows = 64, 64, 13
    weight = torch.zeros(outputs, inputs)
    weight[:, [0, 2, 3]] = torch.tensor([1.0, -1.0, 2.0 ** -30])  # the first output's terms: x = 1 at 0, 2, 3
    weight[1::2, [4, 6, 7]] = torch.tensor([2.0, -2.0, 2.0 ** -29])  # odd outputs add a second such sum
    linear = torch.nn.Linear(inputs, outputs, bias=False).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    x = torch.zeros(rows, inputs, dtype=dtype)
    x[:, [0, 2, 3, 4, 6, 7]] = 1
    out = cpu_ops.PanelLinear(linear)(x).float()
    assert torch.equal(out[:, 0::2], torch.full((rows, outputs // 2), 2.0 ** -30))
    assert torch.equal(out[:, 1::2], torch.full((rows, outputs // 2), 2.0 ** -29))


def test_panel_products_do_not_depend_on_the_threads():
    torch.manual_seed(1)
    panel = cpu_ops.PanelLinear(torch.nn.Linear(96, 300))
    x = torch.randn(30, 96)
    assert torch.equal(panel(x), on_one_thread(panel, x))


def test_panels_replace_float32_and_bfloat16_products_where_the_extension_has_vectors(monkeypatch):
    f32, bf16 = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8).to(torch.bfloat16)
    for bits, want in ((512, True), (256, True), (0, False)):  # AVX-512, AVX2, scalar
        monkeypatch.setattr(cpu_ops, "vector_bits", lambda bits=bits: bits)
        assert (cpu_ops.panels_apply(f32), cpu_ops.panels_apply(bf16)) == (want, want), bits
    assert not cpu_ops.panels_apply(torch.nn.Linear(16, 8).double())  # float64: torch's products


def test_the_products_setting_gives_onednn_what_it_serves_and_refuses_what_it_does_not_know(monkeypatch):
    from specdraft.runner import kernels

    f32, bf16 = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8).to(torch.bfloat16)
    monkeypatch.setattr(cpu_ops, "vector_bits", lambda: 512)
    monkeypatch.setenv(cpu_ops.PRODUCTS_ENV, "onednn")
    assert cpu_ops.panels_apply(f32) == (not kernels.packable(f32))
    monkeypatch.setattr(kernels, "packable", lambda linear: linear.weight.dtype == torch.float32)
    assert (cpu_ops.panels_apply(f32), cpu_ops.panels_apply(bf16)) == (False, True)  # no oneDNN bfloat16: panels
    monkeypatch.setenv(cpu_ops.PRODUCTS_ENV, "panels")
    assert (cpu_ops.panels_apply(f32), cpu_ops.panels_apply(bf16)) == (True, True)
    monkeypatch.setenv(cpu_ops.PRODUCTS_ENV, "oneDNN")
    with pytest.raises(ValueError, match="panels .* or onednn"):
        cpu_ops.panels_apply(f32)


def test_a_kernel_setting_the_products_would_not_understand_is_refused(monkeypatch):
    for name, values, wrong, hint in ((cpu_ops.PREFETCH_ENV, ("T0", "T1"), "t1", "T0 .* or T1"),
                                      (cpu_ops.PAIRS_ENV, ("0", "1"), "yes", "1 .* or 0")):
        for value in values:
            monkeypatch.setenv(name, value)
            cpu_ops.check_kernel_envs()
        monkeypatch.setenv(name, wrong)
        with pytest.raises(ValueError, match=f"{name}='{wrong}': set it to {hint}"):
            cpu_ops.check_kernel_envs()
        monkeypatch.delenv(name)


@pytest.mark.skipif(cpu_ops.vector_bits() == 0, reason="the scalar build does not prefetch")
def test_the_prefetch_setting_chooses_where_the_products_prefetch():
    """Chosen by the vendor, or by the setting (read once per process, so each in a process of its own)."""
    import subprocess
    import sys

    code = "import torch; from specdraft.runner import cpu_ops; cpu_ops.load(); print(torch.ops.specdraft_cpu.prefetch_level())"
    for value, level in (("T0", "1"), ("T1", "2")):
        env = {**os.environ, cpu_ops.PREFETCH_ENV: value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == level, (value, out.stdout, out.stderr[-500:])


@pytest.mark.skipif(cpu_ops.vector_bits() != 512, reason="pairs are an AVX-512 path")
def test_bfloat16_products_by_pairs_and_in_float32_lanes_both_sum_in_order():
    """The vendor chooses the bfloat16 path (pairs of inputs on AMD, float32 lanes elsewhere), or the
    setting does (read once per process): each way, in a process of its own, the panels give the
    sequential sum bit for bit at every row count of :data:`PANEL_ROWS`, and add input k before k + 1
    (the sums of :func:`test_panel_products_add_input_k_before_input_k_plus_one`)."""
    import subprocess
    import sys

    from specdraft.models import cpu_flags

    code = f"""
import importlib.util, torch
from specdraft.runner import cpu_ops
spec = importlib.util.spec_from_file_location("panel_tests", {__file__!r})
tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tests)
cpu_ops.load()
for inputs, outputs, bias in tests.PANEL_SHAPES:
    tests.test_panel_products_sum_each_output_in_order_whatever_the_rows(torch.bfloat16, inputs, outputs, bias)
tests.test_panel_products_add_input_k_before_input_k_plus_one(torch.bfloat16)
print(torch.ops.specdraft_cpu.bf16_pairs(64))
"""
    for value in ("0", "1"):
        env = {**os.environ, cpu_ops.PAIRS_ENV: value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        native = "avx512_bf16" in cpu_flags()  # the extension is built with the instruction (-march=native)
        assert out.returncode == 0 and out.stdout.strip() == str(value == "1" and native), (value, out.stdout,
                                                                                             out.stderr[-2000:])


def test_compiled_panel_products_equal_eager():
    torch.manual_seed(2)
    panel = cpu_ops.PanelLinear(torch.nn.Linear(64, 40))
    x = torch.randn(7, 64)
    assert torch.equal(torch.compile(panel, fullgraph=True)(x), panel(x))


def test_a_model_without_the_extension_keeps_torchs_operators(monkeypatch):
    """Where the extension cannot be built, the model runs torch's operators (as before), still row-invariant."""
    monkeypatch.setattr(cpu_ops, "applies", lambda model: "no C++ compiler (test)")
    runner = load_runner(tiny_hf("llama", dtype=torch.bfloat16))
    assert runner.model.kernels["cpu_ops"] == "no C++ compiler (test)"
    assert all(block.lean is None for block in runner.model.layers)
    assert differing_widths(runner, 96, range(1, 9)) == ([], [])


# -- how many operators a decode step dispatches -------------------------------------------------------

#: operators a decoder layer may dispatch that do work (views not counted), in a one-token step
LAYER_BOUND = 12


class _Count(TorchDispatchMode):
    """Operators dispatched, by name, views (an output aliasing an input, not written) apart."""

    def __init__(self):
        super().__init__()
        self.work, self.views = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        (self.views if view else self.work)[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def step_operators(runner, width: int = 1) -> collections.Counter:
    """Operators that do work in one ``width``-token pass after a 20-token prompt."""
    vocab = runner.model.args.vocab_size
    tokens = torch.randint(vocab, (1, 20 + width), generator=torch.Generator().manual_seed(0))
    runner.cache.reset(1, 64)
    with torch.inference_mode():
        runner.forward(tokens[:, :20])
        runner.forward(tokens[:, 20:20 + width])  # warm (first-call work is not a step's)
        runner.cache.set_lengths([20])
        with _Count() as count:
            runner.forward(tokens[:, 20:20 + width])
    return count.work


def layer_operators(make_runner) -> tuple[float, collections.Counter]:
    """Operators per layer: the step of a 4-layer model less that of a 2-layer one, halved."""
    two, four = step_operators(make_runner(2)), step_operators(make_runner(4))
    per_layer = four.copy()
    per_layer.subtract(two)
    return sum(per_layer.values()) / 2, +per_layer


@pytest.mark.parametrize("fused", ["all-layers", "fused", "operator-by-operator"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_decoder_layer_dispatches_at_most_12_operators(dtype, fused):
    """The three ways a layer runs: every layer in one ``decoder_layers`` call, one
    ``decoder_layer`` call per layer (products on panels or GGUF blocks), and its ten operators one
    by one from Python (products of oneDNN: AMX machines)."""
    from transformers import AutoModelForCausalLM

    def make(n_layers):
        torch.manual_seed(0)
        config = tiny_config("llama")
        config.num_hidden_layers = n_layers
        runner = load_runner(AutoModelForCausalLM.from_config(config).to(dtype).eval())
        if fused != "all-layers":
            runner.model.fused_layers = None
        for block in runner.model.layers:
            block.fused = block.fused if fused != "operator-by-operator" else None
        return runner

    per_layer, ops_seen = layer_operators(make)
    assert per_layer <= LAYER_BOUND, f"{per_layer} operators per layer: {dict(ops_seen)}"
    # the C++ operators run (2 layers more): the whole layer in one where its products allow
    if fused == "all-layers" and cpu_ops.fused_layer(make(1).model.layers[0]) is not None:
        assert per_layer == 0 and step_operators(make(2))["specdraft_cpu.decoder_layers"] == 1, dict(ops_seen)
    elif fused == "fused" and cpu_ops.fused_layer(make(1).model.layers[0]) is not None:
        assert ops_seen["specdraft_cpu.decoder_layer"] == 2 and per_layer <= 2, dict(ops_seen)
    else:
        assert ops_seen["specdraft_cpu.attention"] == 2


@pytest.mark.parametrize("first_norm", ["rms", "identity"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_fused_layer_gives_its_operators_bits(dtype, first_norm):
    """``decoder_layer`` (and ``decoder_layers``, every layer in one call) calls the layer's
    operators from C++: every logit of prefill, one-token steps and verify passes the same bits as
    the operators called one by one (with the layer's first norm, and without, as EAGLE's layer
    has it)."""
    runner = load_runner(tiny_hf("llama", dtype=dtype))
    if first_norm == "identity":
        for block in runner.model.layers:
            block.attention_norm = torch.nn.Identity()
            block.fused = cpu_ops.fused_layer(block)
        runner.model.fused_layers = cpu_ops.fused_layers(runner.model.layers)
    fused, whole = [block.fused for block in runner.model.layers], runner.model.fused_layers
    assert all(f is not None for f in fused) == cpu_ops.panels_apply(torch.nn.Linear(8, 8).to(dtype)) == \
        (whole is not None)
    vocab = runner.model.args.vocab_size
    tokens = torch.randint(vocab, (2, 40), generator=torch.Generator().manual_seed(3))
    outs = []
    for way in ("all-layers", "fused", "operator-by-operator"):  # every layer in one call too
        runner.model.fused_layers = whole if way == "all-layers" else None
        for block, f in zip(runner.model.layers, fused):
            block.fused = f if way != "operator-by-operator" else None
        runner.cache.reset(2, 64)
        with torch.inference_mode():
            got = [runner.forward(tokens[:, :30])[0]]
            for width in (1, 2, 5):
                runner.cache.set_lengths([30, 30])
                got.append(runner.forward(tokens[:, 30:30 + width])[0])
            runner.cache.set_lengths([30, 30])  # the layers' inputs EAGLE-3 reads, collected on the way
            got.extend(runner.forward(tokens[:, 30:33], hidden=(0, 1)))
        outs.append(got)
    for a, b, c in zip(*outs):
        assert torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.e2e
def test_a_default_model_step_dispatches_at_most_12_operators_per_layer(default_bf16):
    model, _ = default_bf16
    runner = load_runner(model)
    work = step_operators(runner)
    n_layers = runner.model.args.n_layers
    outside = work["aten.embedding"] + 40  # the step's own: embedding, positions, mask, rotary tables, head
    assert sum(work.values()) <= LAYER_BOUND * n_layers + outside, dict(work)
    assert work["specdraft_cpu.attention"] + work["specdraft_cpu.decoder_layer"] == n_layers or \
        work["specdraft_cpu.decoder_layers"] == 1, dict(work)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weights_on_huge_pages_give_the_same_bits(dtype, monkeypatch):
    """The products' weights moved into one mapping advised for transparent huge pages (where the
    system has them): every panel inside it, 2 MiB aligned at its start, and every logit of
    prefill and steps the same bits as with the weights where torch put them."""
    if cpu_ops.huge_pages_reason():
        pytest.skip(cpu_ops.huge_pages_reason())
    if not cpu_ops.panels_apply(torch.nn.Linear(8, 8).to(dtype)):
        pytest.skip(f"{dtype} products are not panels here")
    model = tiny_hf("llama", dtype=dtype)
    tokens = torch.randint(model.config.vocab_size, (2, 36), generator=torch.Generator().manual_seed(4))
    outs = []
    for on in ("1", "0"):
        monkeypatch.setenv("SPECDRAFT_HUGE_PAGES", on)
        runner = load_runner(copy.deepcopy(model))
        panels = [m.panels for m in runner.model.modules() if type(m) is cpu_ops.PanelLinear]
        assert panels
        if on == "1":
            assert runner.model.kernels["huge_pages"].endswith(" MB")
            starts = sorted(p.data_ptr() for p in panels)
            assert starts[0] % cpu_ops.HUGE_PAGE == 0
            assert starts[-1] - starts[0] < sum(p.numel() * p.element_size() + 64 for p in panels)  # one region
        else:
            assert "huge_pages" not in runner.model.kernels
        runner.cache.reset(2, 64)
        with torch.inference_mode():
            got = [runner.forward(tokens[:, :30])[0]]
            for width in (1, 3):
                runner.cache.set_lengths([30, 30])
                got.append(runner.forward(tokens[:, 30:30 + width])[0])
        outs.append(got)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
