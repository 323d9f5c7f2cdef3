"""The static cache: masks from lengths, rollback by writing lengths, ragged rows in one batch."""

from __future__ import annotations

import pytest
import torch

from specdraft.cache import KVCache, StaticCache, attention_mask
from specdraft.runner import from_transformers
from specdraft.testing.architectures import tiny_hf

T, F = True, False


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)


def test_mask_sees_committed_positions_and_the_pass_causally():
    mask = attention_mask(torch.tensor([0, 2]), width=2, max_len=5)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[:, 0].tolist() == [
        [[T, F, F, F, F], [T, T, F, F, F]],
        [[T, T, T, F, F], [T, T, T, T, F]],
    ]


def test_mask_with_tree_and_window():
    tree = torch.tensor([[[F, F, F], [T, F, F], [T, F, F]]])  # both later tokens see the first; diagonal implied
    mask = attention_mask(torch.tensor([2]), width=3, max_len=6, tree_mask=tree)
    assert mask[0, 0].tolist() == [
        [T, T, T, F, F, F],
        [T, T, T, T, F, F],
        [T, T, T, F, T, F],
    ]
    windowed = attention_mask(torch.tensor([3]), width=2, max_len=6, window=2)  # itself and one before
    assert windowed[0, 0].tolist() == [[F, F, T, T, F, F], [F, F, F, T, T, F]]


def test_lengths_advance_roll_back_and_reset():
    cache = KVCache(layers=1, slots=3, kv_heads=1, max_len=8, head_dim=2, dtype=torch.float32)
    cache.advance(None, 4)
    cache.advance(torch.tensor([2, 0]), torch.tensor([1, 3]))
    assert cache.lengths.tolist() == [7, 4, 5]
    cache.set_lengths(torch.tensor([2]), rows=torch.tensor([1]))
    assert cache.lengths.tolist() == [7, 2, 5]
    cache.set_lengths(torch.tensor([1, 1, 1]))
    cache.reset(torch.tensor([0]))
    assert cache.lengths.tolist() == [0, 1, 1]


def test_update_writes_each_row_at_its_own_length():
    cache = KVCache(layers=1, slots=2, kv_heads=1, max_len=6, head_dim=1, dtype=torch.float32)
    cache.set_lengths(torch.tensor([1, 3]))
    new = torch.tensor([[10.0, 11.0], [20.0, 21.0]]).view(2, 1, 2, 1)  # [B, kv_heads, W, head_dim]
    positions = cache.lengths[:, None] + torch.arange(2)
    keys, values = cache.update(0, None, positions, new, -new)
    assert keys[:, 0, :, 0].tolist() == [[0, 10, 11, 0, 0, 0], [0, 0, 0, 20, 21, 0]]
    assert torch.equal(values, -keys)
    with pytest.raises((IndexError, RuntimeError)):  # past max_len: an error, never a wrap-around
        cache.update(0, None, positions + 4, new, new)


@pytest.fixture(scope="module")
def model():
    model, reason = from_transformers(tiny_hf("llama3-tied"))
    assert model is not None, reason
    return model


@torch.no_grad()
def test_rollback_then_new_tokens_equal_a_fresh_prefill(model):
    gen = torch.Generator().manual_seed(0)
    prompt, drafts, other = (torch.randint(1, 96, (1, n), generator=gen) for n in (9, 4, 3))
    cache = model.new_cache(slots=1, max_len=32)
    model(prompt, cache)
    model(drafts, cache)  # four drafts written, positions 9..12
    cache.set_lengths(torch.tensor([10]))  # keep the first draft only
    out = model(other, cache)

    kept = torch.cat([prompt, drafts[:, :1], other], dim=1)  # 13 tokens
    fresh = model.new_cache(slots=1, max_len=32)
    expected = model(kept, fresh)
    assert cache.lengths.tolist() == fresh.lengths.tolist() == [13]
    close(out.logits, expected.logits[:, -3:])
    for layer in range(len(model.layers)):
        close(cache.keys[layer][:, :, :13], fresh.keys[layer][:, :, :13])
        close(cache.values[layer][:, :, :13], fresh.values[layer][:, :, :13])


@torch.no_grad()
def test_ragged_batch_equals_per_row_prefills(model):
    gen = torch.Generator().manual_seed(1)
    lens = [5, 9, 2]
    prompts = [torch.randint(1, 96, (1, n), generator=gen) for n in lens]
    steps = torch.randint(1, 96, (3, 4), generator=gen)
    batch = torch.zeros(3, 9, dtype=torch.long)
    for b, p in enumerate(prompts):
        batch[b, :lens[b]] = p[0]
    cache = model.new_cache(slots=3, max_len=24)
    first = model(batch, cache, advance=torch.tensor(lens))
    second = model(steps, cache)

    for b, p in enumerate(prompts):
        alone = model.new_cache(slots=1, max_len=24)
        first_alone = model(p, alone)
        second_alone = model(steps[b:b + 1], alone)
        close(first.logits[b, :lens[b]], first_alone.logits[0])
        close(second.logits[b], second_alone.logits[0])
        n = lens[b] + 4
        for layer in range(len(model.layers)):
            close(cache.keys[layer][b, :, :n], alone.keys[layer][0, :, :n])
            close(cache.values[layer][b, :, :n], alone.values[layer][0, :, :n])


def _numbered(slots: int, max_len: int) -> KVCache:
    """A one-layer cache whose key at (slot, position) is ``100 * slot + position`` (values negated)."""
    cache = KVCache(1, slots, 1, max_len, 1, torch.float32)
    marks = 100 * torch.arange(slots)[:, None] + torch.arange(max_len)  # [slots, max_len]
    cache.keys[0].copy_(marks[:, None, :, None].float())
    cache.values[0].copy_(-marks[:, None, :, None].float())
    return cache


def test_static_cache_rolls_back_per_slot_and_keeps_what_it_stores_when_it_grows():
    cache = StaticCache(_numbered, headroom=8)
    cache.reset(rows=2, max_len=10)
    assert cache.kv.max_len == 256 and cache.capacity == 248 and cache.lengths.tolist() == [0, 0]
    cache.set_lengths([5, 7])
    cache.set_lengths([3], slots=[1])  # rollback of one row
    assert cache.lengths.tolist() == [5, 3] and cache.bounds == [5, 3]
    assert cache.grow([1], 4) == 3 and cache.bounds == [5, 7]  # a pass of 4 tokens on slot 1
    before = cache.kv.keys[0].clone()
    cache.reserve(300, rows=3)  # grows: doubled capacity, a third row, everything stored kept
    assert (cache.kv.slots, cache.kv.max_len, cache.epoch) == (3, 512, 2)
    assert torch.equal(cache.kv.keys[0][:2, :, :256], before) and cache.lengths.tolist() == [5, 3, 0]
    with pytest.raises(ValueError, match="reserve"):
        cache.grow(None, 600)


def test_keep_paths_moves_each_accepted_tree_path_into_place():
    cache = StaticCache(_numbered)
    cache.reset(rows=3, max_len=10)
    cache.kv = _numbered(3, 256)
    # slot 0 committed 4 tokens (positions 0..3; its tree's nodes at 4..); it took nodes 1 and 3
    # slot 2 committed 2 tokens; it took node 2 alone; slot 1 is left alone
    cache.keep_paths([(0, 3, [1, 3]), (2, 1, [2])])
    keys = cache.kv.keys[0][:, 0, :, 0]  # [slots, max_len]
    assert keys[0, :8].tolist() == [0, 1, 2, 3, 5, 7, 6, 7]  # nodes 1, 3 (positions 5, 7) now at 4, 5
    assert keys[2, :5].tolist() == [200, 201, 204, 203, 204]  # node 2 (position 4) now at 2
    assert keys[1, :8].tolist() == [100 + p for p in range(8)]
    assert torch.equal(cache.kv.values[0], -cache.kv.keys[0])
