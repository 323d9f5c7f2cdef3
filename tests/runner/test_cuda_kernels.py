"""The CUDA kernels (``specdraft.runner.cuda_kernels``) on this CPU, under Triton's interpreter.

The interpreter runs each Triton program in numpy (float32 and float16; it has no bfloat16), so
these check what the kernels compute — against float64 references — and that each row or token
is bit-identical however many rows or tokens share the call: widths 1..16, ragged rows, a
gathered subset, masked tails and trees. The same checks run on a GPU when a model loads there
(``make_invariant``) and in ``benchmarks/gpu_checklist.sh``. Sizes are tiny: the interpreter
executes every program in Python.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from specdraft.runner import cuda_kernels as ck  # noqa: E402
from specdraft.runner.kernels import tree_order  # noqa: E402

DTYPES = (torch.float32, torch.float16)

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it before triton is imported
    pytest.skip("the kernels run on CPU tensors under TRITON_INTERPRET=1 only", allow_module_level=True)


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(dtype, bias):
    # inner 100 and out 70: neither a multiple of the tiles (masked K tail and N edge)
    x, w = _randn(20, 100, dtype=dtype), _randn(70, 100, dtype=dtype, seed=1)
    b = _randn(70, dtype=dtype, seed=2) if bias else None
    y = ck.triton_linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == dtype and y.shape == (20, 70)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_row_count(dtype):
    x, w = _randn(41, 72, dtype=dtype), _randn(70, 72, dtype=dtype, seed=1)
    alone = torch.cat([ck.triton_linear(x[i:i + 1], w) for i in range(x.shape[0])])
    for n in (*range(2, 17), 31, 33, 40):
        for offset in (0, 1):  # a view that starts one row in
            assert torch.equal(ck.triton_linear(x[offset:offset + n], w), alone[offset:offset + n]), (n, offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_split_linear_matches_float64_and_its_rows_do_not_depend_on_the_row_count(dtype, bias, monkeypatch):
    """The split product (SPECDRAFT_CUDA_LINEAR=split): the inner dimension cut into parts whose
    sums are added in part order by a second kernel. Here 600 inner positions in 4 parts of 256
    (the last one past the end: masked), 70 outputs (an N edge); and the rule's one part where a
    weight already makes its programs."""
    monkeypatch.setattr(ck, "SPLIT_BLOCK_K", 64)
    monkeypatch.setattr(ck, "SPLIT_PROGRAMS", 8)
    x, w = _randn(20, 600, dtype=dtype), _randn(70, 600, dtype=dtype, seed=1)
    b = _randn(70, dtype=dtype, seed=2) if bias else None
    assert ck.split_of(70, 600) == 4 and ck.split_of(8 * ck.BLOCK_N, 600) == 1
    y = ck.split_linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype and y.shape == (20, 70) and torch.allclose(y.double(), ref, atol=tol, rtol=tol)
    alone = torch.cat([ck.split_linear(x[i:i + 1], w, b) for i in range(x.shape[0])])
    for n in (2, 3, 5, 9, 16, 17):
        for offset in (0, 1):
            assert torch.equal(ck.split_linear(x[offset:offset + n], w, b), alone[offset:offset + n]), (n, offset)
    if dtype == torch.float32:  # really another order of sums (float16's rounding can hide it)
        assert not torch.equal(y, ck.triton_linear(x, w, b))


def test_the_split_rule_depends_on_the_shape_alone():
    """A 3B model's decode products: few output tiles are split (up to 16 parts of at least two
    inner steps), many are not."""
    assert ck.split_of(3072, 3072) == 8  # 48 tiles: attention's output
    assert ck.split_of(3072, 8192) == 16  # the MLP's down product
    assert ck.split_of(16384, 3072) == 2  # gate and up together
    assert ck.split_of(128256, 3072) == 1  # the LM head
    assert ck.split_of(960, 576) == 2  # the default model's QKV: two parts of 288
    assert ck.split_of(960, 500) == 1  # too short for two parts of two steps


def test_the_wanted_triton_product_is_checked_first(monkeypatch):
    monkeypatch.setattr(ck, "CHECKED_ROWS", (1, 2, 3, 5))
    monkeypatch.setattr(ck, "_CHECKED_MODES", {})
    w = _randn(24, 40)
    monkeypatch.setenv(ck.LINEAR_ENV, "split")
    assert ck.checked_linear_mode(w, None)[0] == "split"
    monkeypatch.setenv(ck.LINEAR_ENV, "tiles")
    assert ck.checked_linear_mode(w, None)[0] == "triton"
    monkeypatch.setenv(ck.LINEAR_ENV, "fast")
    with pytest.raises(ValueError, match="SPECDRAFT_CUDA_LINEAR must be 'tiles' or 'split'"):
        ck.checked_linear_mode(w, None)


def test_the_load_time_check_falls_back_from_a_row_count_dependent_product(monkeypatch):
    """Triton's tiles are taken when they pass; a product whose rows change with the row count is
    refused, cuBLAS is the second choice, and one row at a time the last."""
    monkeypatch.setattr(ck, "CHECKED_ROWS", (1, 2, 3, 5, 8))
    monkeypatch.setattr(ck, "_CHECKED_MODES", {})
    w = _randn(24, 40)
    mode, why = ck.checked_linear_mode(w, None)
    assert mode == "triton" and "every row count" in why
    linear = F.linear

    def drifting(x, weight, bias=None):  # a last bit that depends on how many rows there are
        return linear(x, weight, bias) * (1 + 1e-6 * (x.shape[0] % 3))

    monkeypatch.setattr(ck, "_CHECKED_MODES", {})
    monkeypatch.setattr(ck, "triton_linear", drifting)
    monkeypatch.setattr(ck.F, "linear", lambda x, weight, bias=None: (x[:, None, :] * weight).sum(-1))  # per row
    assert ck.checked_linear_mode(w, None)[0] == "cublas"
    monkeypatch.setattr(ck, "_CHECKED_MODES", {})
    monkeypatch.setattr(ck.F, "linear", drifting)
    assert ck.checked_linear_mode(w, None)[0] == "rows"


def _causal(starts, width, span, window=None):
    pos = torch.arange(span)
    query = torch.tensor(starts)[:, None] + torch.arange(width)  # [B, W]
    mask = pos[None, None, :] <= query[:, :, None]
    if window is not None:
        mask &= pos[None, None, :] > query[:, :, None] - window
    return mask[:, None]  # [B, 1, W, span]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 20])
def test_attention_matches_float64(dtype, window):
    # GQA (6 query heads over 2 KV heads), head dim 24 (not a power of two), a span of 130 positions
    q = _randn(2, 6, 5, 24, dtype=dtype)
    keys, values = _randn(2, 2, 130, 24, dtype=dtype, seed=1), _randn(2, 2, 130, 24, dtype=dtype, seed=2)
    mask = _causal((40, 90), 5, 130, window)
    out = ck.triton_attention(q, keys, values, mask, 24**-0.5)
    ref = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=mask,
                                         scale=24**-0.5, enable_gqa=True)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert out.dtype == dtype and torch.allclose(out.double(), ref, atol=tol, rtol=tol)


def test_tree_attention_reads_keys_in_the_order_given():
    """A tree token's output is attention over the positions its order index lists as seen."""
    q = _randn(1, 4, 6, 16)
    keys, values = _randn(1, 2, 64, 16, seed=1), _randn(1, 2, 64, 16, seed=2)
    parents = (-1, 0, 0, 1, 1, 2)
    mask = torch.zeros(1, 1, 6, 64, dtype=torch.bool)
    mask[0, 0, :, :30] = True
    for node, parent in enumerate(parents):
        mask[0, 0, node, 30 + node] = True
        if parent >= 0:
            mask[0, 0, node, 30:36] |= mask[0, 0, parent, 30:36]
    out = ck.triton_attention(q, keys, values, mask, 0.25, tree_order(mask))
    ref = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=mask, scale=0.25,
                                         enable_gqa=True)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_attention_tokens_equal_their_one_token_steps():
    """Passes of 1..16 tokens over two rows of ragged lengths and a wider span than the one-token
    steps' (a masked tail), and a tree whose tokens read their keys through an order index:
    every token bit-identical to its one-token call (``attention_invariant``, the load-time check).
    float16 (bfloat16's stand-in here); float32 runs in the whole-model test below."""
    assert ck.attention_invariant(ck.decode_attention, 4, 2, 16, torch.float16, "cpu", widths=(1, 2, 3, 4, 7, 8, 16),
                                  starts=(37, 70), span=192)


def test_the_attention_check_catches_a_kernel_whose_tokens_depend_on_the_pass():
    def leaky(q, keys, values, mask, scale, order=None):  # every token shifted by the pass's width
        return ck.decode_attention(q, keys, values, mask, scale, order) * (1 + 1e-3 * (q.shape[2] - 1))

    assert not ck.attention_invariant(leaky, 4, 2, 16, torch.float32, "cpu", widths=(1, 2), starts=(5,), span=64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_and_its_rows_are_alone(dtype, monkeypatch):
    x, w = _randn(3, 5, 40, dtype=dtype), _randn(40, dtype=dtype, seed=1)
    h = x.float()
    ref = (w.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).double())
    y = ck.rms_norm(x, w, 1e-5)
    assert y.shape == x.shape and torch.allclose(y.double(), ref, atol=1e-2 if dtype == torch.float16 else 1e-5)
    monkeypatch.setattr(ck, "CHECKED_ROWS", (1, *range(2, 17), 24))
    assert ck.rms_norm_invariant(ck.rms_norm, 40, dtype, "cpu")


def test_a_compiled_runner_with_the_cuda_kernels_is_row_invariant(monkeypatch):
    """The whole model with its linears, attention and norms replaced as on CUDA (the kernels
    interpreted on CPU), compiled as a CUDA-graphed runner is (each kernel one opaque operator
    in the graph): passes of 2 and 3 tokens over two ragged rows, and over a gathered subset,
    give each token the logits of its one-token step, bit for bit (float32). The regular buckets
    are cut to 1..2 here, so that 3 tokens run in the 64-token bucket such a runner adds past them
    (as 33 tokens do with the real buckets; asserted: run eagerly past the last bucket, passes of
    48 and 64 tokens differed on an H100, where eager elementwise operations round otherwise than
    the compiled graph's; on this CPU they happen to round alike, so the widths alone would not
    catch a missing bucket). 3 rather than 33 one-token steps a row: the interpreted kernels' steps
    are the test's time."""
    from specdraft.runner import ModelRunner
    from specdraft.runner import runner as runner_module
    from specdraft.runner.convert import from_transformers
    from specdraft.runner.model import CUDA_DECODE_WIDTH
    from specdraft.testing import differing_widths, tiny_llama

    monkeypatch.setattr(ck, "CHECKED_ROWS", (1, 2, 3, 4))
    monkeypatch.setattr(ck, "CHECKED_WIDTHS", (1, 2))
    monkeypatch.setattr(ck, "_CHECKED_MODES", {})
    monkeypatch.setattr(runner_module, "WIDTH_BUCKETS", (1, 2))
    monkeypatch.setattr(ck.F, "linear", lambda x, weight, bias=None: (x.double() @ weight.double().T).to(x.dtype)
                        * (1 + 1e-6 * (x.shape[0] % 2)))  # a stand-in for cuBLAS that is not row-invariant
    # one layer: every kernel a layer has, at half the interpreted launches of two (the one-token
    # steps the passes are compared with dominate the test's time)
    model, _ = from_transformers(tiny_llama(vocab_size=64, seed=0, layers=1, dtype=torch.float32))
    linears = {id(m) for m in model.modules() if type(m) is torch.nn.Linear}
    model.kernels = ck.make_invariant(model, CUDA_DECODE_WIDTH)
    runner = ModelRunner(model, compile=True)
    assert runner.info["kernels"]["linear"] == {"triton": len(linears)}
    assert runner.info["kernels"]["attention"] == "triton" and runner.info["kernels"]["rms_norm"] == "triton"
    assert runner.info["kernels"]["layers"].startswith("fused")  # the layers run lean_ops (below)
    assert all(block.lean.rope_write.__name__ == "run" for block in model.layers)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert runner.buckets == (1, 2, CUDA_DECODE_WIDTH) and CUDA_DECODE_WIDTH == 64
    # two ragged rows (and the second alone, gathered): the one-token steps are the test's time
    # prompts of 2 and 1 tokens: prefilled in the small buckets (an interpreted 64-token pass is
    # about 15 s), cached lengths still ragged
    assert differing_widths(runner, 64, (1, 2, 3), prompt_lengths=(2, 1), subset=(1,)) == ([], [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layers_fused_kernels_match_float64(dtype):
    """The residual add with the norm, SwiGLU, the rotation with the cache write and the attention
    over the cache's slots in place (lean_ops) against torch in float64; rows alone equal rows together."""
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    x, y = _randn(2, 3, 48, dtype=dtype, seed=1), _randn(2, 3, 48, dtype=dtype, seed=2)
    weight = _randn(48, dtype=dtype, seed=3).abs() + 0.5
    total, normed = ck.triton_add_rms_norm(x, y, weight, 1e-5)
    assert torch.equal(total, x + y)
    assert torch.equal(normed, ck.triton_rms_norm(total, weight, 1e-5))
    g = _randn(2, 3, 2 * 40, dtype=dtype, seed=4)
    gate, up = g.double().chunk(2, dim=-1)
    assert torch.allclose(ck.triton_silu_mul(g).double(), F.silu(gate) * up, atol=tol, rtol=tol)
    assert torch.equal(ck.triton_silu_mul(g)[1:, 2:], ck.triton_silu_mul(g[1:, 2:]))

    heads, kv_heads, dim, width = 4, 2, 16, 3
    qkv = _randn(2, width, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=5)
    positions = torch.tensor([[4, 5, 6], [0, 1, 2]])
    freqs = positions[..., None].float() * (1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    k_buf, v_buf = torch.zeros(3, kv_heads, 24, dim, dtype=dtype), torch.zeros(3, kv_heads, 24, dim, dtype=dtype)
    slot = torch.tensor([2, 0])
    q = ck.triton_rope_write(qkv, cos, sin, k_buf, v_buf, slot, positions, heads, kv_heads)
    qq, kk, vv = qkv.double().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)

    def rotate(t, n):
        t = t.view(2, width, n, dim).transpose(1, 2)
        return t * cos.double() + torch.cat((-t[..., dim // 2:], t[..., :dim // 2]), dim=-1) * sin.double()

    assert torch.allclose(q.double(), rotate(qq, heads), atol=tol, rtol=tol)
    for b, s in enumerate(slot.tolist()):
        assert torch.allclose(k_buf[s][:, positions[b]].double(), rotate(kk, kv_heads)[b], atol=tol, rtol=tol)
        assert torch.equal(v_buf[s][:, positions[b]], vv.view(2, width, kv_heads, dim).transpose(1, 2)[b].to(dtype))
    assert not k_buf[1].any()

    k_buf, v_buf = _randn(3, kv_heads, 24, dim, dtype=dtype, seed=6), _randn(3, kv_heads, 24, dim, dtype=dtype, seed=7)
    mask = _causal([7, 3], width, 24)
    out = ck.triton_lean_attention(q, k_buf, v_buf, slot, mask, 0.25)  # [B, W, heads * dim]
    ref = F.scaled_dot_product_attention(q.double(), k_buf[slot].double(), v_buf[slot].double(), attn_mask=mask,
                                         scale=0.25, enable_gqa=True)
    assert torch.allclose(out.double(), ref.transpose(1, 2).reshape(2, width, -1), atol=tol, rtol=tol)
    gathered = ck.triton_attention(q, k_buf[slot], v_buf[slot], mask, 0.25)  # the same sums as a gathered copy
    assert torch.equal(out, gathered.transpose(1, 2).reshape(2, width, -1))
