"""Tiny random transformers models of each architecture specdraft runs: llama, llama3-tied,
mistral-window, qwen2-tied, qwen3 (``KINDS``).

Each is 2 layers, vocabulary 96, float64 by default, with weights far from transformers' init
(norm weights not 1, biases not 0), so a term the runner misses shows in its logits::

    from specdraft.testing.architectures import KINDS, tiny_hf
    for kind in KINDS:
        hf = tiny_hf(kind)  # a transformers model in eval mode

``tiny_config(kind, **overrides)`` is the config alone (for testing what the runner refuses).
"""

from __future__ import annotations

import math

#: what every kind shares
COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0,
)
LLAMA3_ROPE = {  # original_max_position_embeddings small, so every branch of the scaling applies
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}
KINDS = ["llama", "llama3-tied", "mistral-window", "qwen2-tied", "qwen3"]


def tiny_config(kind: str, **overrides):
    """The transformers config of ``kind`` (see ``KINDS``), with ``overrides`` set on it."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    configs = {
        "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
        "llama3-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE)),
        "mistral-window": lambda: MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=5),
        "qwen2-tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
        # head_dim 24 is not hidden_size / heads (16); one KV head for all four query heads
        "qwen3": lambda: Qwen3Config(**(COMMON | dict(num_key_value_heads=1)), head_dim=24, tie_word_embeddings=False),
    }
    config = configs[kind]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def randomize(model, seed: int = 0):
    """Weights far from transformers' init (norm weights 1, biases 0), so a missed term shows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
            if p.ndim == 1:
                p.copy_(1 + 0.3 * noise if "norm" in name else 0.5 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))
    return model


def tiny_hf(kind: str, seed: int = 0, dtype=None):
    """A random 2-layer transformers model of ``kind`` (see ``KINDS``), in eval mode (float64 by default)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind))
    return randomize(model, seed).to(dtype or torch.float64).eval()


__all__ = ["COMMON", "KINDS", "LLAMA3_ROPE", "randomize", "tiny_config", "tiny_hf"]
