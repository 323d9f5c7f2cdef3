"""Weight-only int8 / int4 linears: accuracy against the dequantised weights, determinism,
row-independence (a row's output does not depend on the other rows of the batch), and whole
tiny models quantized in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdraft.runner import from_transformers
from specdraft.runner.quantize import (Int4Linear, Int8Linear, quantize_groups, quantize_int4, quantize_int8,
                                       quantize_rows)
from specdraft.testing.architectures import tiny_hf

ROWS = 33  # row counts 1..33: a verify pass of K+1 positions against one-token steps
#: (in, out): SmolLM2-135M's gate/up-sized product, a vocabulary-sized head, and widths the kernels
#: cannot take as they are (in not a multiple of 16 or of the group size, out not a multiple of 16)
SHAPES = [(576, 1536), (64, 49152), (40, 101)]


def linear(inp: int, out: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(inp, out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out, inp, generator=gen) / inp ** 0.5)
        layer.weight[1 % out] = 0  # an all-zero row
        if bias:
            layer.bias.copy_(torch.randn(out, generator=gen))
    return layer


def assert_row_independent(module: nn.Module, inp: int, dtype: torch.dtype) -> None:
    """``module(x[:m])`` equals the rows computed one at a time, bit for bit, for m = 1..ROWS."""
    x = torch.randn(ROWS, inp, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        singles = torch.cat([module(x[i:i + 1].clone()) for i in range(ROWS)])
        for m in range(1, ROWS + 1):
            assert torch.equal(module(x[:m].clone()), singles[:m]), f"rows={m}"
        # and a row taken out of the middle of a bigger tensor (offset storage, a view)
        assert torch.equal(module(x[3:8]), singles[3:8])


# ---- int8 -------------------------------------------------------------------------------------


def test_quantize_rows_is_symmetric_per_row_with_zero_rows_guarded():
    w = linear(64, 96).weight
    q, scales = quantize_rows(w, torch.float32)
    assert q.dtype == torch.int8 and q.shape == w.shape and scales.shape == (96,)
    assert scales[1] == 1 and (q[1] == 0).all()  # the all-zero row
    nonzero = torch.arange(96) != 1
    assert (q[nonzero].abs().amax(dim=1) == 127).all()
    assert ((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inp,out", [(576, 960), (40, 101)])
def test_int8_matches_dequantized_reference(inp, out, bias):
    layer = linear(inp, out, bias)
    module = Int8Linear.from_linear(layer)
    assert module.weight.dtype == torch.int8 and module.scales.dtype == torch.float32
    x = torch.randn(2, 3, inp, dtype=torch.float64)
    reference = x @ module.dequantized(torch.float64).T + (layer.bias.double() if bias else 0)  # [2, 3, out]
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference, rtol=0, atol=1e-12)  # float64: the dequantised path
        torch.testing.assert_close(module(x.float()).double(), reference, rtol=1e-4, atol=1e-4)  # the kernel
        assert module(x.float()).shape == (2, 3, out)
        bf16 = Int8Linear.from_linear(layer, compute_dtype=torch.bfloat16)
        got = bf16(x.float())
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), reference, rtol=0.03, atol=0.03)
        torch.testing.assert_close(module(x.bfloat16()).double(), reference, rtol=0.03, atol=0.03)
        on_bf16 = Int8Linear.from_linear(linear(inp, out, bias).bfloat16())  # a bfloat16 model's layer
        reference = x @ on_bf16.dequantized(torch.float64).T + (layer.bias.bfloat16().double() if bias else 0)
        torch.testing.assert_close(on_bf16(x.bfloat16()).double(), reference, rtol=0.03, atol=0.03)
    # the dequantised weight is within half a step of the float weight
    step = module.scales.double()[:, None]
    assert ((module.dequantized(torch.float64) - layer.weight.double()).abs() <= step / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_is_deterministic(dtype):
    layer = linear(576, 1536, bias=True).to(dtype)
    module = Int8Linear.from_linear(layer)
    assert module.scales.dtype == dtype  # so the kernel runs in dtype
    again = Int8Linear.from_linear(layer)
    for name, buf in module.state_dict().items():
        assert torch.equal(buf, again.state_dict()[name]), name
    x = torch.randn(5, 576).to(dtype)
    with torch.no_grad():
        first = module(x)
        for _ in range(5):
            assert torch.equal(module(x), first)
        assert torch.equal(again(x), first)


@pytest.mark.parametrize("inp,out", SHAPES)
@pytest.mark.parametrize("dtype,compute", [(torch.float32, None), (torch.bfloat16, None),
                                           (torch.float32, torch.bfloat16)],
                         ids=["float32", "bfloat16", "float32-model-bfloat16-products"])
def test_int8_rows_are_independent(inp, out, dtype, compute):
    module = Int8Linear.from_linear(linear(inp, out, bias=True).to(dtype), compute_dtype=compute)
    assert_row_independent(module, inp, dtype)


def test_int8_unaligned_input_is_handled():
    """The bfloat16 kernel loads 16 features at a time, aligned: an input view at an odd offset
    must still give the same result as an aligned copy."""
    module = Int8Linear.from_linear(linear(64, 96).bfloat16())
    flat = torch.randn(64 * 3 + 1).bfloat16()
    x = flat[1:].view(3, 64)  # contiguous, storage offset of 2 bytes
    with torch.no_grad():
        assert torch.equal(module(x), module(x.clone()))


# ---- whole models -----------------------------------------------------------------------------


def _tokens():
    gen = torch.Generator().manual_seed(3)
    return torch.randint(1, 96, (2, 6), generator=gen), torch.randint(1, 96, (2, 4), generator=gen)


@torch.no_grad()
def _logits(model, prompt, new):
    """Logits of a 4-token pass after a prompt, and of the same 4 tokens one step at a time."""
    cache = model.new_cache(slots=2, max_len=16)
    model(prompt, cache)
    wide = model(new, cache).logits  # [2, 4, vocab]
    cache = model.new_cache(slots=2, max_len=16)
    model(prompt, cache)
    steps = torch.cat([model(new[:, i:i + 1], cache).logits for i in range(new.shape[1])], dim=1)
    return wide, steps


@pytest.mark.parametrize("kind", ["llama", "llama3-tied", "qwen2-tied", "qwen3"])
def test_quantize_int8_model_is_close_and_keeps_the_embedding_float(kind):
    reference, _ = from_transformers(tiny_hf(kind))  # float64
    model, _ = from_transformers(tiny_hf(kind))
    embedding = model.tok_embeddings.weight
    replaced = quantize_int8(model)
    assert replaced == 4 * model.args.n_layers + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.output, Int8Linear) and isinstance(model.layers[0].attention.wqkv, Int8Linear)
    assert (model.layers[0].attention.wqkv.bias is not None) == (kind == "qwen2-tied")
    assert model.tok_embeddings.weight is embedding and embedding.dtype == torch.float64
    if model.args.tie_embeddings:  # the head got an int8 copy; the shared float weight is untouched
        torch.testing.assert_close(embedding, reference.tok_embeddings.weight, rtol=0, atol=0)
    prompt, new = _tokens()
    expected, _ = _logits(reference, prompt, new)
    got, _ = _logits(model, prompt, new)
    scale = expected.abs().max()
    assert (got - expected).abs().max() < 0.1 * scale  # loose: int8 weights, random tiny model


def test_quantizing_twice_gives_identical_weights():
    first, _ = from_transformers(tiny_hf("qwen2-tied", dtype=torch.float32))
    second, _ = from_transformers(tiny_hf("qwen2-tied", dtype=torch.float32))
    quantize_int8(first)
    quantize_int8(second)
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert a["output.weight"].dtype == torch.int8 and a["tok_embeddings.weight"].dtype == torch.float32


class _Tree(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(8, 16)
        self.a, self.b = shared, shared
        self.seq = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16, bias=False))
        self.embed = nn.Embedding(10, 8)
        self.attn = nn.MultiheadAttention(16, 2)  # its out_proj is an nn.Linear subclass it reads directly
        self.head = nn.Bilinear(4, 4, 4)


def test_quantize_any_module_tree():
    tree = _Tree()
    assert quantize_int8(tree) == 3
    assert tree.a is tree.b and isinstance(tree.a, Int8Linear)
    assert isinstance(tree.seq[0], Int8Linear) and isinstance(tree.seq[2], Int8Linear)
    assert type(tree.embed) is nn.Embedding and type(tree.head) is nn.Bilinear
    assert type(tree.attn.out_proj) is not Int8Linear
    with pytest.raises(TypeError):
        quantize_int8(nn.Linear(4, 4))


# ---- int4 -------------------------------------------------------------------------------------


def test_quantize_groups_range():
    w = linear(64, 16).weight
    q, scales, zeros = quantize_groups(w, 32, torch.float32)
    assert q.min() >= 0 and q.max() <= 15 and scales.shape == zeros.shape == (16, 2)
    deq = ((q.view(16, 2, 32).float() - 8) * scales[..., None] + zeros[..., None]).view(16, 64)
    assert ((deq - w).abs() <= scales.repeat_interleave(32, dim=1) / 2 * (1 + 1e-5) + 1e-6).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inp,out,group", [(576, 960, 32), (576, 960, 64), (384, 96, 128), (512, 48, 256),
                                           (40, 101, 32)])
def test_int4_matches_dequantized_reference(inp, out, group, bias):
    layer = linear(inp, out, bias)
    module = Int4Linear.from_linear(layer, group)
    deq = module.dequantized(torch.float64)
    assert deq.shape == (out, inp)
    # within half a step of the float weight (step: the group's range / 15)
    w = layer.weight.double()
    padded = torch.nn.functional.pad(w, (0, module.in_padded - inp)).view(out, -1, group)
    step = (padded.amax(-1) - padded.amin(-1)) / 15
    tol = step.repeat_interleave(group, dim=1)[:, :inp] * 0.51 + 1e-2 * step.max()  # scales rounded to bf16
    assert ((deq - w).abs() <= tol).all()
    x = torch.randn(2, 3, inp, dtype=torch.float64)
    reference = x @ deq.T + (layer.bias.double() if bias else 0)
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference, rtol=0, atol=1e-12)
        got = module(x.float())
        assert got.dtype == torch.float32 and got.shape == (2, 3, out)
        torch.testing.assert_close(got.double(), reference, rtol=0.03, atol=0.03)
        torch.testing.assert_close(module(x.bfloat16()).double(), reference, rtol=0.03, atol=0.03)


@pytest.mark.parametrize("inp,out", SHAPES)
def test_int4_rows_are_independent_and_deterministic(inp, out):
    layer = linear(inp, out, bias=True)
    module = Int4Linear.from_linear(layer, 32)
    assert_row_independent(module, inp, torch.bfloat16)
    again = Int4Linear.from_linear(layer, 32)
    x = torch.randn(5, inp).bfloat16()
    with torch.no_grad():
        assert torch.equal(again(x), module(x)) and torch.equal(module(x), module(x))


def test_int4_float32_kernel_rows_are_independent():
    assert_row_independent(Int4Linear.from_linear(linear(576, 1536), 64, compute_dtype=torch.float32), 576,
                           torch.float32)


def test_quantize_int4_model():
    reference, _ = from_transformers(tiny_hf("llama3-tied", dtype=torch.bfloat16))
    model, _ = from_transformers(tiny_hf("llama3-tied", dtype=torch.bfloat16))
    twice, _ = from_transformers(tiny_hf("llama3-tied", dtype=torch.bfloat16))
    assert quantize_int4(model, 32) == 9 and quantize_int4(twice, 32) == 9
    assert isinstance(model.output, Int4Linear) and model.tok_embeddings.weight.dtype == torch.bfloat16
    for name, buf in model.state_dict().items():
        assert torch.equal(buf, twice.state_dict()[name]), name
    prompt, new = _tokens()
    expected, _ = _logits(reference, prompt, new)
    wide, steps = _logits(model, prompt, new)
    assert torch.equal(wide, steps)
    # 4-bit weights on a random tiny model: the logits move a lot, but stay correlated
    diff = (wide.float() - expected.float()).abs().max()
    assert diff < 0.6 * expected.float().abs().max()


@pytest.mark.parametrize("make", [lambda layer: Int8Linear.from_linear(layer),
                                  lambda layer: Int8Linear.from_linear(layer, compute_dtype=torch.bfloat16),
                                  lambda layer: Int4Linear.from_linear(layer, 32)], ids=["int8", "int8-bf16", "int4"])
def test_compiled_equals_eager(make):
    """The runner compiles its blocks with fullgraph=True: the modules must trace, and inductor's
    result must be the eager one bit for bit (bias added in float32 and rounded once in both)."""
    torch._dynamo.reset()
    module = make(linear(64, 96, bias=True))
    compiled = torch.compile(module, fullgraph=True, dynamic=False)
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(compiled(x), module(x))
