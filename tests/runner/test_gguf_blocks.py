"""quantize="gguf": a GGUF file's own Q4_0/Q4_1/Q8_0 blocks as the products (specdraft.runner.gguf_blocks).

The blocks read as llama.cpp's reference (gguf-py) dequantises them; the products are row-invariant
by construction (bit-identical whatever the rows beside a row) and close to float64; a model loaded
from a file written as llama.cpp's converter writes one speculates exactly (greedy output equal to
plain decoding of the same blocks); a file whose layout the loader misreads is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdraft import ConfigError, SamplingParams, SpeculativeDecoder
from specdraft.runner import cpu_ops, load_runner
from specdraft.runner.gguf_blocks import BlockLinear, dequantize, read_blocks
from specdraft.testing import SIGNIFICANCE, on_one_thread, repetitive_prompts, sampled_joint_pvalue, tiny_llama
from specdraft.testing.gguf import write_gguf

pytestmark = pytest.mark.skipif(cpu_ops.load() != "", reason=f"no C++ extension here: {cpu_ops.load()}")
KINDS = ["Q4_0", "Q4_1", "Q8_0"]


def _blocks(kind: str, rows: int, cols: int, seed: int = 0):
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(weight, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(rows, cols)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_read_as_llama_cpp_dequantises_them(kind):
    raw, want = _blocks(kind, 5, 96)
    q, d, m = read_blocks(raw, kind, 5, 96)
    assert (m is None) == (kind == "Q8_0")
    assert torch.equal(dequantize(q, d, m), torch.from_numpy(want))


#: (inputs, outputs, bias): whole panels, a last partial one, one group of 32 inputs
SHAPES = [(96, 64, False), (64, 50, True), (32, 200, False)]
#: row counts across the tiles (one row alone; 6 rows a tile, then a rest of 1-5)
ROWS = [1, 2, 3, 5, 6, 7, 11, 12, 13]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs,outputs,bias", SHAPES)
def test_block_products_are_row_invariant_and_close_to_float64(kind, dtype, inputs, outputs, bias):
    raw, _ = _blocks(kind, outputs, inputs, seed=inputs + outputs)
    q, d, m = read_blocks(raw, kind, outputs, inputs)
    gen = torch.Generator().manual_seed(1)
    b = torch.randn(outputs, generator=gen).to(dtype) if bias else None
    linear = BlockLinear(q, d, m, bias=b, kind=kind)
    x = torch.randn(max(ROWS), inputs, generator=gen).to(dtype)
    full = linear(x)
    assert full.dtype == dtype and full.shape == (max(ROWS), outputs)
    for rows in ROWS:  # every row's bits the same in a call of any size
        assert torch.equal(linear(x[:rows]), full[:rows]), rows
    assert torch.equal(torch.cat([linear(x[i:i + 1]) for i in range(4)]), full[:4])
    assert torch.equal(linear(x[:6].view(2, 3, inputs)), full[:6].view(2, 3, outputs))  # leading dims kept
    # the arithmetic as cpu_ops.cpp states it (each row's 8-bit groups, exact integer sums), in float64
    want = _quantised_reference(x, q, d, m) + (0 if b is None else b.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # float32 steps; bfloat16: one rounding of the output
    torch.testing.assert_close(full.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    # ... which is the dequantised weight's product up to the 8-bit rounding of the inputs
    exact = x.double() @ dequantize(q, d, m, torch.float64).T + (0 if b is None else b.double())
    torch.testing.assert_close(full.double(), exact, rtol=0.05, atol=0.05 * exact.abs().max().item())
    torch.testing.assert_close(linear(x.double()), exact)  # float64 inputs: the dequantised weight


def _quantised_reference(x, q, d, m):
    """``specdraft_cpu::block_linear``'s arithmetic: each row quantised to 8 bits per group of 32
    (scale max |x| / 127, ties to even), integer products summed exactly, each group's sum times
    ``d * scale`` (float32), plus ``m`` times the group's sum of x."""
    rows, k = x.shape
    xg = x.float().reshape(rows, k // 32, 32)
    amax = xg.abs().amax(-1)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    qx = torch.round(xg * inverse[..., None]).clamp(-127, 127).long()  # [M, G, 32]
    qw = q.long().reshape(q.shape[0], k // 32, 32)  # [N, G, 32]
    isum = torch.einsum("mgi,ngi->mng", qx, qw).double()
    terms = isum * (d.float()[None] * (amax / 127)[:, None, :]).double()
    if m is not None:
        terms = terms + m.double()[None] * xg.double().sum(-1)[:, None, :]
    return terms.sum(-1)


def test_block_products_do_not_depend_on_the_threads():
    raw, _ = _blocks("Q4_1", 300, 96)
    linear = BlockLinear(*read_blocks(raw, "Q4_1", 300, 96))
    x = torch.randn(7, 96)
    assert torch.equal(linear(x), on_one_thread(linear, x))


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    model = tiny_llama(vocab_size=64, seed=5, dtype=torch.float32)
    write_gguf(model, tmp_path_factory.mktemp("gguf"), "Q4_1")
    return model


def _plain(model, prompts, n):
    dec = SpeculativeDecoder(model, None, drafter="none", quantize="gguf")
    return [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=n)]


@pytest.mark.parametrize("drafter", ["ngram", "prompt-lookup"])
@pytest.mark.parametrize("k", [1, 4])
def test_a_model_on_its_gguf_blocks_speculates_exactly(gguf_model, drafter, k):
    prompts = repetitive_prompts(64, seed=0)[:3]  # ragged batch of 3
    expected = _plain(gguf_model, prompts, 24)
    dec = SpeculativeDecoder(gguf_model, None, drafter=drafter, spec_length=k, quantize="gguf", adaptive=False)
    assert dec.runner_info["kernels"]["gguf_blocks"] == "9 of 9 layers (Q4_1)"  # 2 layers x 4 and the head
    results = dec.generate_ids(prompts, max_new_tokens=24)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.accepted_tokens for r in results) > 0  # drafts were accepted, not just bonus tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_on_gguf_blocks_keeps_the_targets_distribution(tmp_path, dtype):
    """Sampled speculation on the blocks: the first K + 1 tokens of many samples against the blocks
    model's exact distribution (enumerated from its own plain decoding), chi-square at SIGNIFICANCE."""
    model = tiny_llama(vocab_size=64, seed=9, dtype=dtype)
    write_gguf(model, tmp_path, "Q4_1")
    dec = SpeculativeDecoder(model, None, drafter="ngram", spec_length=3, quantize="gguf", adaptive=False,
                             max_batch=512)
    assert dec.runner_info["kernels"]["gguf_blocks"] == "9 of 9 layers (Q4_1)"
    pvalue, results = sampled_joint_pvalue(dec, [3, 5, 3, 5, 3], SamplingParams(temperature=0.8, top_k=4), seed=3)
    assert sum(r.stats.drafted_tokens for r in results) >= len(results)  # every row drafted
    assert pvalue > SIGNIFICANCE


def test_the_blocks_are_the_files_model(gguf_model):
    """The products on blocks give the logits of the float model whose weights are the blocks' values
    (write_gguf set them), up to the 8-bit rounding of the products' inputs: the loader put every
    tensor where it belongs."""
    tokens = torch.tensor([repetitive_prompts(64, seed=0)[0]])
    outs = []
    for quantize in (None, "gguf"):
        runner = load_runner(gguf_model, quantize=quantize)
        runner.cache.reset(1, tokens.shape[1])
        with torch.inference_mode():
            outs.append(runner.forward(tokens)[0])
    scale = outs[0].abs().max().item()
    torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.05 * scale)
    assert (outs[1] - outs[0]).abs().max().item() > 1e-6 * scale  # the blocks ran, not the float weights


def test_a_file_in_another_layout_is_refused(tmp_path):
    model = tiny_llama(vocab_size=64, seed=6, dtype=torch.float32)
    write_gguf(model, tmp_path, "Q4_1", permute=False)  # q and k not in llama.cpp's order
    with pytest.raises(ConfigError, match="attn_q.weight .* does not match the model's weight"):
        load_runner(model, quantize="gguf")


def test_gguf_blocks_need_a_gguf_target():
    with pytest.raises(ConfigError, match="load the target from a .gguf file"):
        load_runner(tiny_llama(vocab_size=64, seed=7, dtype=torch.float32), quantize="gguf")


def test_the_blocks_are_read_once_then_from_beside_the_model(tmp_path, monkeypatch):
    import os

    import gguf

    from specdraft.runner.gguf_blocks import BLOCKS_CACHE, file_blocks

    path = write_gguf(tiny_llama(vocab_size=64, seed=8, dtype=torch.float32), tmp_path, "Q8_0")
    cache = tmp_path / BLOCKS_CACHE
    blocks, kinds = file_blocks(path, cache)
    assert cache.is_file() and set(kinds.values()) == {"Q8_0"} and len(blocks) == len(kinds) == 15

    def unreadable(*args, **kwargs):
        raise AssertionError("the file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", unreadable)
    again, _ = file_blocks(path, cache)
    for name, (q, d, m) in blocks.items():
        assert torch.equal(again[name][0], q) and torch.equal(again[name][1], d) and again[name][2] is m is None
    os.utime(path, ns=(0, 0))  # another file now: the cache does not hold its blocks
    with pytest.raises(AssertionError, match="parsed again"):
        file_blocks(path, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_0_blocks_made_as_llama_cpp_makes_them(dtype):
    """A weight without a GGUF file (a drafter's) quantized as gguf-py's reference of llama.cpp's
    ``quantize_row_q8_0`` does, bit for bit, a group of zeros included."""
    import gguf

    from specdraft.runner.gguf_blocks import quantize_q8_0

    weight = torch.from_numpy(np.random.default_rng(5).standard_normal((7, 96)).astype(np.float32)) * 3
    weight[2, 32:64] = 0
    weight = weight.to(dtype)
    raw = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    want_q, want_d, _ = read_blocks(raw, "Q8_0", 7, 96)
    q, d, m = quantize_q8_0(weight)
    assert m is None and torch.equal(q, want_q) and torch.equal(d, want_d)
