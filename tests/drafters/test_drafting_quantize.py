"""The head drafters' ``quantize`` option: their products on llama.cpp's Q8_0 blocks.

``auto`` (the default) puts EAGLE's layer (one fused call), its ``fc``, medusa's blocks and the LM
head rows they read on 8-bit blocks where specdraft's CPU operator runs (float32, bfloat16), and
leaves float64 (the parity tests) and other devices as they are; ``none`` keeps the weights as
loaded; ``q8_0`` asks for the blocks and is refused, with the fix, where they cannot run. Drafts
may change; greedy output stays plain decoding's (here), the sampled distribution the target's
(tests/engine/test_exactness.py, ``test_head_sampling_in_bfloat16``, both settings).
"""

from __future__ import annotations

import pytest
import torch

from specdraft import ConfigError, SpeculativeDecoder
from specdraft.runner import cpu_ops
from specdraft.runner.gguf_blocks import BlockLinear
from specdraft.services import DrafterServices
from specdraft.testing import random_heads, repetitive_prompts, tiny_llama

needs_ops = pytest.mark.skipif(cpu_ops.load() != "", reason=f"no C++ extension here: {cpu_ops.load()}")


@needs_ops
@pytest.mark.parametrize(("quantize", "dtype", "device", "want"), [
    ("auto", torch.float32, "cpu", "q8_0"),
    ("auto", torch.bfloat16, "cpu", "q8_0"),
    ("auto", torch.float64, "cpu", None),
    ("auto", torch.float16, "cpu", None),
    ("auto", torch.bfloat16, "cuda", None),
    ("none", torch.bfloat16, "cpu", None),
    ("q8_0", torch.bfloat16, "cpu", "q8_0"),
    ("q8_0", torch.float64, "cpu", "q8_0"),  # the blocks' dequantised weights (tests)
])
def test_what_quantize_means_where(quantize, dtype, device, want):
    assert DrafterServices().drafting_quantize(quantize, device, dtype) == want


@pytest.mark.parametrize(("quantize", "dtype", "device", "match"), [
    ("q8_0", torch.float16, "cpu", "multiplies float32 and bfloat16"),
    ("q8_0", torch.bfloat16, "cuda", "CPU operator"),
    ("q4", torch.bfloat16, "cpu", "use one of auto, none, q8_0"),
])
def test_quantize_refused_where_it_cannot_run(quantize, dtype, device, match):
    with pytest.raises(ConfigError, match=match) as err:
        DrafterServices().drafting_quantize(quantize, device, dtype)
    assert quantize != "q8_0" or "quantize=none" in str(err.value)


def test_a_bad_value_is_refused_by_the_options(tmp_path):
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32)
    heads = random_heads("eagle", model, tmp_path / "eagle", seed=1)
    with pytest.raises(ConfigError, match="quantize"):
        SpeculativeDecoder(model, None, drafter="eagle", drafter_options={"heads": str(heads), "quantize": "int8"})


def _plain(model, prompts, n):
    return [r.token_ids for r in SpeculativeDecoder(model, None, drafter="none").generate_ids(prompts, max_new_tokens=n)]


def _products(module) -> set[str]:
    return {type(m).__name__ for m in module.modules() if type(m).__name__ in ("BlockLinear", "PanelLinear", "Linear")}


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_eagle_drafts_on_blocks_and_its_output_is_plain_decodings(tmp_path, dtype):
    model = tiny_llama(vocab_size=64, seed=0, dtype=dtype)
    heads = random_heads("eagle", model, tmp_path / "eagle", seed=1, scale=2.0)
    prompts = repetitive_prompts(64, seed=2)
    want = _plain(model, prompts, 12)
    drafted = {}
    for quantize in ("auto", "none"):
        dec = SpeculativeDecoder(model, None, drafter="eagle", spec_length=3, adaptive=False,
                                 drafter_options={"heads": str(heads), "min_confidence": 0, "quantize": quantize})
        drafter = dec.drafter
        layer = drafter.runner.model.layers[0]
        if quantize == "auto":
            assert drafter.quantize == "q8_0"
            assert isinstance(drafter.head.product, BlockLinear) and drafter.head.product.kind == "Q8_0"
            assert _products(layer) == {"BlockLinear"} and _products(drafter.module.fc) == {"BlockLinear"}
            assert layer.fused is not None  # the layer is still one C++ call, on its blocks
        else:
            assert drafter.quantize is None
            assert _products(layer) == {"PanelLinear"} and not isinstance(drafter.head.product, BlockLinear)
        results = dec.generate_ids(prompts, max_new_tokens=12)
        assert [r.token_ids for r in results] == want
        drafted[quantize] = sum(r.stats.drafted_tokens for r in results)
        assert drafted[quantize] > 0


@needs_ops
def test_medusa_blocks_and_own_heads_on_blocks(tmp_path):
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.bfloat16)
    heads = random_heads("medusa", model, tmp_path / "medusa", seed=1, scale=2.0)
    dec = SpeculativeDecoder(model, None, drafter="medusa", spec_length=3, adaptive=False,
                             drafter_options={"heads": str(heads), "min_confidence": 0})
    assert _products(dec.drafter.module) == {"BlockLinear"} and isinstance(dec.drafter.head.product, BlockLinear)
    prompts = repetitive_prompts(64, seed=3)
    assert [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=10)] == _plain(model, prompts, 10)


def test_float64_keeps_its_weights_unless_asked(tmp_path):
    """``auto`` leaves a float64 drafter alone; ``q8_0`` there multiplies the blocks' dequantised
    weights in float64, and greedy output is transformers' plain greedy decoding."""
    from specdraft.testing import plain_greedy

    model = tiny_llama(vocab_size=64, seed=0)
    heads = random_heads("eagle", model, tmp_path / "eagle", seed=1, scale=2.0)
    prompts = repetitive_prompts(64, seed=4)
    for quantize, blocks in (("auto", False), ("q8_0", True)):
        dec = SpeculativeDecoder(model, None, drafter="eagle", spec_length=3, adaptive=False,
                                 drafter_options={"heads": str(heads), "min_confidence": 0, "quantize": quantize})
        assert isinstance(dec.drafter.head.product, BlockLinear) == blocks
        assert any(isinstance(m, BlockLinear) for m in dec.drafter.runner.model.modules()) == blocks
        for p, r in zip(prompts, dec.generate_ids(prompts, max_new_tokens=8)):
            assert r.token_ids == plain_greedy(model, p, 8)
