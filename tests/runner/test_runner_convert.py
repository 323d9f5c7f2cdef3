"""from_transformers: what it builds, and a readable reason for what it refuses."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from specdraft.runner import from_transformers


def test_weights_keep_dtype_device_and_share_storage(hf_factory):
    hf = hf_factory("llama", dtype=torch.float32)
    model, reason = from_transformers(hf)
    assert reason == ""
    assert model.dtype == torch.float32 and model.device == hf.device
    assert not any(p.requires_grad for p in model.parameters())
    # embeddings and unfused projections are transformers' tensors, not copies
    assert model.tok_embeddings.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert model.layers[1].attention.wo.weight.data_ptr() == hf.model.layers[1].self_attn.o_proj.weight.data_ptr()
    attn = hf.model.layers[0].self_attn
    assert torch.equal(model.layers[0].attention.wqkv.weight,
                       torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama3-tied", True), ("qwen2-tied", True), ("qwen3", False)])
def test_tied_and_untied_embeddings(hf_factory, kind, tied):
    model, _ = from_transformers(hf_factory(kind))
    assert model.args.tie_embeddings is tied
    assert (model.output.weight is model.tok_embeddings.weight) is tied


def test_architecture_specific_args(hf_factory):
    qwen3, _ = from_transformers(hf_factory("qwen3"))
    assert qwen3.args.head_dim == 24 != qwen3.args.dim // qwen3.args.n_heads and qwen3.args.qk_norm
    assert from_transformers(hf_factory("qwen2-tied"))[0].args.qkv_bias
    assert from_transformers(hf_factory("mistral-window"))[0].args.sliding_window == 5
    assert from_transformers(hf_factory("llama3-tied"))[0].args.rope_llama3 == (8.0, 1.0, 4.0, 16)


def _refused(hf_model):
    model, reason = from_transformers(hf_model)
    assert model is None
    assert reason and "\n" not in reason
    return reason


def test_unsupported_architecture_is_named():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    reason = _refused(gpt2)
    assert "GPT2LMHeadModel is not a supported architecture" in reason and "LlamaForCausalLM" in reason


@pytest.mark.parametrize("kind,overrides,words", [
    ("llama", dict(attention_bias=True), "attention_bias=True"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True"),
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_type='linear'"),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    ("qwen2-tied", dict(sliding_window=4, layer_types=["full_attention", "sliding_attention"]), "some layers only"),
])
def test_unsupported_config_features_are_named(config_factory, kind, overrides, words):
    config = config_factory(kind)
    model = AutoModelForCausalLM.from_config(config)
    for key, value in overrides.items():  # set after building: the check reads the config, not the modules
        setattr(model.config, key, value)
    assert words in _refused(model)


def test_sliding_window_on_every_layer_is_supported(config_factory):
    config = config_factory("qwen3", sliding_window=4, layer_types=["sliding_attention"] * 2)
    hf = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    model, reason = from_transformers(hf)
    assert reason == "" and model.args.sliding_window == 4
    tokens = torch.randint(1, 96, (1, 10), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(slots=1, max_len=16)
    with torch.no_grad():
        ours = torch.cat([model(tokens[:, :6], cache).logits, model(tokens[:, 6:], cache).logits], dim=1)
        torch.testing.assert_close(ours, hf(tokens).logits, rtol=0, atol=1e-10)
