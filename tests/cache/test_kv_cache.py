"""KVCache: rollback is a length change, and a rolled-back cache equals a fresh prefill."""

from __future__ import annotations

import pytest
import torch

from specdraft.cache import KVCache, forward_step


def _fresh(model, ids):
    cache = KVCache(model.config.num_hidden_layers, slots=64)
    cache.reset(ids.shape[0])
    logits = forward_step(model, cache, ids)
    return cache, logits


def test_rollback_then_continue_equals_fresh_prefill(tiny_model):
    torch.manual_seed(0)
    seq = torch.randint(0, 64, (1, 20))
    cache, _ = _fresh(tiny_model, seq[:, :10])
    forward_step(tiny_model, cache, seq[:, 10:15])  # 5 "draft" tokens ...
    cache.rollback([12])  # ... of which 2 were accepted
    logits = forward_step(tiny_model, cache, seq[:, 12:20])
    fresh_cache, fresh_logits = _fresh(tiny_model, seq)
    assert torch.allclose(logits, fresh_logits[:, 12:20], atol=1e-10)
    for ours, ref in zip(cache.layers, fresh_cache.layers):
        assert torch.allclose(ours.keys[:, :, :20], ref.keys[:, :, :20], atol=1e-10)
        assert torch.allclose(ours.values[:, :, :20], ref.values[:, :, :20], atol=1e-10)


def test_rollback_copies_nothing_and_buffers_are_reused(tiny_model):
    seq = torch.randint(0, 64, (1, 12))
    cache, _ = _fresh(tiny_model, seq[:, :8])
    pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    cache.rollback([3])
    assert cache.lengths == [3]
    forward_step(tiny_model, cache, seq[:, 3:12])
    cache.reset(1)
    forward_step(tiny_model, cache, seq)
    assert pointers == [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]


def test_rows_with_different_lengths_match_single_rows(tiny_model):
    torch.manual_seed(1)
    a, b = torch.randint(0, 64, (1, 9)), torch.randint(0, 64, (1, 9))
    cache, _ = _fresh(tiny_model, torch.cat([a, b]))
    cache.rollback([4, 7])  # rows now disagree on length: writes become per-row scatters
    logits = forward_step(tiny_model, cache, torch.cat([a[:, 4:6], b[:, 7:9]]))
    _, ref_a = _fresh(tiny_model, a[:, :6])
    _, ref_b = _fresh(tiny_model, b[:, :9])
    assert torch.allclose(logits[0], ref_a[0, 4:6], atol=1e-10)
    assert torch.allclose(logits[1], ref_b[0, 7:9], atol=1e-10)


def test_invalid_rollback_and_overflow_are_refused(tiny_model):
    cache, _ = _fresh(tiny_model, torch.randint(0, 64, (1, 5)))
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback([6])
    with pytest.raises(ValueError, match="lengths for a batch"):
        cache.rollback([1, 2])
    with pytest.raises(ValueError, match="overflow"):
        forward_step(tiny_model, cache, torch.zeros((1, 60), dtype=torch.long))


def test_cpu_passes_keep_grouped_heads_and_match_the_models_own_forward(tiny_model, monkeypatch):
    """specdraft's CPU attention (grouped K/V heads not copied per query head) computes what
    transformers' own "sdpa" forward does, for prefill, multi-token and one-token passes."""
    from specdraft.cache import kv_cache

    assert tiny_model.config.num_key_value_heads < tiny_model.config.num_attention_heads  # a grouped model
    calls = []
    real = kv_cache._cpu_gqa_attention
    monkeypatch.setattr(kv_cache, "_cpu_gqa_attention", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, kv_cache.CPU_ATTENTION, kv_cache._cpu_gqa_attention)
    torch.manual_seed(2)
    seq = torch.randint(0, 64, (2, 16))
    reference = tiny_model(seq).logits  # transformers' own path, no cache
    cache = KVCache(tiny_model.config.num_hidden_layers, slots=32)
    cache.reset(2)
    parts = [forward_step(tiny_model, cache, seq[:, a:b]) for a, b in ((0, 9), (9, 13), (13, 14), (14, 16))]
    assert torch.allclose(torch.cat(parts, dim=1), reference, atol=1e-10)
    assert len(calls) == 4 * tiny_model.config.num_hidden_layers  # every layer of every pass went through it
    assert tiny_model.config._attn_implementation == "sdpa"  # and the model is left as it was
