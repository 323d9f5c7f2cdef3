"""Sharding a target over ranks, without the ranks: shares, shapes, refusals, and shards that
put back together are the model (the processes are tested in tests/e2e/test_tensor_parallel_e2e.py)."""

from __future__ import annotations

import types

import pytest
import torch

from specdraft import ConfigError
from specdraft.runner import from_transformers
from specdraft.runner import tp
from specdraft.runner.tp import check_shardable, shard_args, shard_state, shares
from specdraft.testing.architectures import tiny_hf


def test_shares_are_as_equal_as_the_counts_allow():
    assert shares(3, 2) == [(0, 2), (2, 1)]  # SmolLM2-135M's KV heads over 2 ranks
    assert shares(1536, 2) == [(0, 768), (768, 768)]
    assert shares(7, 3) == [(0, 3), (3, 2), (5, 2)]


def test_more_ranks_than_kv_heads_is_refused_with_the_counts():
    model, _ = from_transformers(tiny_hf("qwen3"))  # 4 query heads, 1 KV head
    with pytest.raises(ConfigError, match=r"tensor_parallel=2 is more ranks than this model's 1 KV heads "
                                          r"\(4 attention heads\).*choose at most 1"):
        check_shardable(model.args, 2)
    check_shardable(model.args, 1)


@pytest.mark.parametrize("kind", ["llama3-tied", "qwen2-tied"])  # tied head; q/k/v bias
def test_shards_put_back_together_are_the_model(kind):
    """Each rank's rows of wqkv (its KV heads' queries, keys, values) and w13 (its units' gate and
    up), and columns of wo and w2, reassemble every weight; the rest is replicated, shared."""
    model, _ = from_transformers(tiny_hf(kind))
    a, world = model.args, 2
    states = [shard_state(model, r, world) for r in range(world)]
    full = model.state_dict()
    for r, state in enumerate(states):
        local = shard_args(a, r, world)
        assert local.n_kv_heads == shares(a.n_kv_heads, world)[r][1] and local.n_heads * a.n_kv_heads == \
            local.n_kv_heads * a.n_heads
        assert state["layers.0.attention.wqkv.weight"].shape[0] == (local.n_heads + 2 * local.n_kv_heads) * a.head_dim
        assert state["layers.0.feed_forward.w2.weight"].shape[1] == local.intermediate_size
        assert state["tok_embeddings.weight"].data_ptr() == full["tok_embeddings.weight"].data_ptr()
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    for name in full:
        parts = [s[name] for s in states]
        if name.endswith(("wqkv.weight", "wqkv.bias")):
            sizes = [(shard_args(a, r, world).n_heads * a.head_dim, shard_args(a, r, world).n_kv_heads * a.head_dim)
                     for r in range(world)]
            split = [p.split([qs, ks, ks]) for p, (qs, ks) in zip(parts, sizes)]
            rebuilt = torch.cat([torch.cat([s[i] for s in split]) for i in range(3)])
            assert rebuilt.shape[0] == q + 2 * kv
        elif name.endswith("w13.weight"):
            halves = [p.chunk(2) for p in parts]
            rebuilt = torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
        elif name.endswith(("wo.weight", "w2.weight")):
            rebuilt = torch.cat(parts, dim=1)
        else:
            assert all(torch.equal(p, full[name]) for p in parts)
            continue
        assert torch.equal(rebuilt, full[name]), name


@pytest.mark.parametrize("value", ["ten", "0", "-5"])
def test_a_bad_pass_timeout_is_refused_with_one_line(monkeypatch, value):
    monkeypatch.setenv("SPECDRAFT_TP_TIMEOUT", value)
    with pytest.raises(ConfigError, match=rf"SPECDRAFT_TP_TIMEOUT must be a number of seconds > 0, got '{value}'"):
        tp.pass_timeout()
    monkeypatch.setenv("SPECDRAFT_TP_TIMEOUT", "2.5")
    assert tp.pass_timeout().total_seconds() == 2.5


def test_a_target_on_another_device_cannot_join_the_running_group(monkeypatch):
    """One group per process, on one device: a second decoder's target elsewhere is refused
    before any message goes out (the other ranks would run a pass rank 0 cannot)."""
    monkeypatch.setattr(tp, "_GROUP", tp.Group(2, torch.device("cpu"), []))
    assert tp.start(2, "cpu") is tp._GROUP
    with pytest.raises(ConfigError, match=r"already runs a tensor-parallel group on cpu; a target on meta cannot "
                                          r"join it.*load it on cpu"):
        tp.start(2, "meta")
    with pytest.raises(ConfigError, match=r"group of 2 ranks; tensor_parallel=3 cannot start another"):
        tp.start(3, "cpu")


def test_a_pass_after_the_ranks_were_stopped_raises_one_line_and_ends_nothing():
    """A stopped group (the program ending) sent nothing, so nothing is out of step: the pass
    raises its ConfigError rather than ending the process as a pass that failed partway does."""
    group = tp.Group(2, torch.device("cpu"), [])
    group.alive = False
    local = types.SimpleNamespace(model=None, compiled=False, quantization=None)
    runner = tp.TensorParallelRunner(group, 0, local)
    with pytest.raises(ConfigError, match="the tensor-parallel ranks have been stopped"):
        runner.forward(torch.tensor([[1, 2]]))
