"""Architectures specdraft's model code does not reproduce run on transformers' module, eagerly,
say so, and keep greedy parity."""

from __future__ import annotations

import pytest
import torch

from specdraft import ConfigError, SpeculativeDecoder
from specdraft.testing import plain_greedy, repetitive_prompts


def _gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    config = GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    return GemmaForCausalLM(config).to(torch.float64).eval()


def _llama_with_mlp_bias():
    from specdraft.testing import tiny_llama

    model = tiny_llama(vocab_size=64, seed=1)
    model.config.mlp_bias = True  # a feature our model code refuses
    return model


@pytest.mark.parametrize("build, reason", [(_gemma, "GemmaForCausalLM is not a supported architecture"),
                                           (_llama_with_mlp_bias, "mlp_bias=True")])
@pytest.mark.parametrize("drafter", ["ngram", "prompt-lookup"])
def test_unsupported_architecture_falls_back_with_parity(build, reason, drafter):
    model = build()
    prompts = repetitive_prompts(64, seed=0)[:3]
    dec = SpeculativeDecoder(model, None, drafter=drafter, spec_length=3)
    assert dec.runner_info == {"implementation": "transformers", "compiled": False, "quantization": None,
                               "dtype": str(model.dtype).removeprefix("torch."), "dtype_reason": "the loaded model's own"}
    assert reason in dec.runner.fallback_reason
    expected = [plain_greedy(model, p, 16) for p in prompts]
    assert [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=16)] == expected


def test_compile_or_quantize_on_a_fallback_model_says_why():
    with pytest.raises(ConfigError, match="compile needs specdraft's own model code.*not a supported architecture"):
        SpeculativeDecoder(_gemma(), None, drafter="ngram", compile=True)
    with pytest.raises(ConfigError, match="quantize='int8' needs specdraft's own model code"):
        SpeculativeDecoder(_gemma(), None, drafter="ngram", quantize="int8")
