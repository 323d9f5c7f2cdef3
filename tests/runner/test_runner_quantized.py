"""quantize="int8" / "int4": the quantized model is the target, so speculative output equals plain
decoding of the same quantized model, for every built-in cheap drafter and a draft model."""

from __future__ import annotations

import pytest
import torch

from specdraft import SpeculativeDecoder
from specdraft.testing import repetitive_prompts, tiny_llama


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["float32", "float64"])
def model(request):
    return tiny_llama(vocab_size=64, seed=5).to(request.param)


def _plain(model, prompts, n, quantize="int8", **kw):
    dec = SpeculativeDecoder(model, None, drafter="none", quantize=quantize, **kw)
    return [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=n)]


def _cpu_ops() -> dict:
    """What the runner's kernels say of specdraft's C++ operators here: built, and where the
    products prefetch (by the processor's vendor)."""
    level = int(torch.ops.specdraft_cpu.prefetch_level())
    return {"cpu_ops": "yes"} | ({"prefetch": f"L{level}"} if level else {})


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("drafter", ["ngram", "prompt-lookup"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_quantized_speculative_equals_quantized_plain(model, drafter, k, quantize):
    prompts = repetitive_prompts(64, seed=0)[:3]  # ragged batch of 3
    expected = _plain(model, prompts, 24, quantize)
    # adaptive=False: always draft k (the adaptive length follows timings, and this asserts acceptance)
    dec = SpeculativeDecoder(model, None, drafter=drafter, spec_length=k, quantize=quantize, adaptive=False)
    assert dec.runner_info == {"implementation": "specdraft", "compiled": False, "quantization": quantize,
                               "dtype": str(dec.runner.dtype).removeprefix("torch."),
                               "kernels": {"packed": 0, **({} if dec.runner.dtype == torch.float64 else _cpu_ops())},
                               "dtype_reason": "the loaded model's own"}
    results = dec.generate_ids(prompts, max_new_tokens=24)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.accepted_tokens for r in results) > 0  # drafts were accepted, not just bonus tokens
    assert dec.generate_ids(prompts[:1], max_new_tokens=24)[0].token_ids == expected[0]


def test_int8_changes_the_model(model):
    """The quantized target is a different model: its logits differ from the float one's (else the
    parity above would prove nothing about quantization)."""
    from specdraft.runner import load_runner

    tokens = torch.tensor([repetitive_prompts(64, seed=0)[0]])
    outs = []
    for quantize in (None, "int8", "int4"):
        runner = load_runner(model, quantize=quantize)
        runner.cache.reset(1, tokens.shape[1])
        with torch.inference_mode():
            outs.append(runner.forward(tokens)[0].to(model.dtype))  # a quantized float32 model runs in bfloat16
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[1], outs[0], rtol=0.1, atol=0.15)  # int8: close


def test_int8_compiled_speculative_equals_int8_plain():
    model = tiny_llama(vocab_size=64, seed=5)
    prompts = repetitive_prompts(64, seed=0)[:3]
    expected = _plain(model, prompts, 20, compile=True)
    dec = SpeculativeDecoder(model, None, drafter="prompt-lookup", spec_length=4, quantize="int8", compile=True)
    assert [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=20)] == expected
