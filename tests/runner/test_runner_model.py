"""Our cached incremental forward equals transformers' full forward, for every architecture."""

from __future__ import annotations

import pytest
import torch

from specdraft.runner import from_transformers
from specdraft.testing.architectures import KINDS

ATOL = 1e-10  # float64: the two paths differ only by summation order


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL)


def reference(hf, seq, **kwargs):
    """transformers' logits for the whole sequence in one forward, no cache.  # [T, vocab]"""
    with torch.no_grad():
        return hf(torch.tensor([seq]), **kwargs).logits[0]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, hf_factory):
    hf = hf_factory(request.param)
    model, reason = from_transformers(hf)
    assert model is not None, reason
    return hf, model


def random_tokens(gen, *shape):
    return torch.randint(1, 96, shape, generator=gen)


@torch.no_grad()
def test_ragged_prefill_then_decode_equals_transformers(pair):
    hf, model = pair
    gen = torch.Generator().manual_seed(1)
    lens = torch.tensor([7, 3, 11])
    tokens = torch.zeros(3, 11, dtype=torch.long)  # right-padded with 0
    seqs = []
    for b, n in enumerate(lens.tolist()):
        tokens[b, :n] = random_tokens(gen, n)
        seqs.append(tokens[b, :n].tolist())
    cache = model.new_cache(slots=3, max_len=40)
    out = model(tokens, cache, advance=lens)
    assert torch.equal(cache.lengths, lens)
    for b, n in enumerate(lens.tolist()):
        close(out.logits[b, :n], reference(hf, seqs[b]))
    # decode steps of width 1 and 4 over rows of different lengths (past mistral's window of 5)
    for width in (1, 4, 1, 4, 4):
        new = random_tokens(gen, 3, width)
        out = model(new, cache)
        assert out.logits.shape == (3, width, 96) and out.logits.dtype == torch.float64
        for b in range(3):
            seqs[b] += new[b].tolist()
            close(out.logits[b], reference(hf, seqs[b])[-width:])
    assert torch.equal(cache.lengths, lens + 14)


@torch.no_grad()
def test_logits_at_and_hidden_states(pair):
    hf, model = pair
    gen = torch.Generator().manual_seed(2)
    tokens = random_tokens(gen, 2, 6)
    cache = model.new_cache(slots=2, max_len=16)
    at = torch.tensor([[5], [2]])
    out = model(tokens, cache, logits_at=at, return_hidden=True)
    assert out.logits.shape == (2, 1, 96)
    for b in range(2):
        close(out.logits[b, 0], reference(hf, tokens[b].tolist())[at[b, 0]])
        close(out.hidden[b], hf.model(tokens[b:b + 1]).last_hidden_state[0])
    assert model(random_tokens(gen, 2, 1), cache).hidden is None


@torch.no_grad()
def test_hidden_states_of_chosen_layers_equal_transformers(pair):
    """``return_hidden=(i, ...)``: the residual stream entering each named block, side by side in
    the order named, from the same pass that gives the logits (prefill, then a decode step)."""
    hf, model = pair
    n = model.args.n_layers
    layers = (n - 1, 0, n // 2)  # any order; block 0's input is the embeddings
    gen = torch.Generator().manual_seed(5)
    tokens = random_tokens(gen, 2, 6)
    cache = model.new_cache(slots=2, max_len=16)
    first = model(tokens, cache, return_hidden=layers)
    step = random_tokens(gen, 2, 2)
    second = model(step, cache, return_hidden=layers)
    dim = model.args.dim
    for b in range(2):
        seq = torch.cat([tokens[b], step[b]])[None]
        expected = torch.cat([hf(seq, output_hidden_states=True).hidden_states[i][0] for i in layers], -1)
        close(torch.cat([first.hidden[b], second.hidden[b]]), expected)  # [8, 3 * dim]
        close(second.logits[b], reference(hf, seq[0].tolist())[-2:])
    assert first.hidden.shape == (2, 6, 3 * dim)
    with pytest.raises(ValueError, match=f"layers 0..{n - 1}"):
        model(step, cache, return_hidden=(n,))


@torch.no_grad()
def test_rows_select_cache_slots(pair):
    hf, model = pair
    gen = torch.Generator().manual_seed(3)
    cache = model.new_cache(slots=3, max_len=16)
    first = random_tokens(gen, 2, 5)
    model(first, cache, rows=torch.tensor([2, 0]))
    assert cache.lengths.tolist() == [5, 0, 5]
    step = random_tokens(gen, 1, 2)
    out = model(step, cache, rows=torch.tensor([0]))
    assert cache.lengths.tolist() == [7, 0, 5]
    close(out.logits[0], reference(hf, first[1].tolist() + step[0].tolist())[-2:])


@torch.no_grad()
def test_tree_mask_hides_tokens_of_the_pass(hf_factory):
    hf = hf_factory("llama")
    model, _ = from_transformers(hf)
    gen = torch.Generator().manual_seed(4)
    prefix, (a, b, c) = random_tokens(gen, 6).tolist(), random_tokens(gen, 3).tolist()
    cache = model.new_cache(slots=1, max_len=16)
    model(torch.tensor([prefix]), cache)
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)  # c sees a, not b
    out = model(torch.tensor([[a, b, c]]), cache, tree_mask=tree)
    close(out.logits[0, :2], reference(hf, prefix + [a, b])[-2:])
    # c at position 8 having seen the prefix and a only
    positions = torch.tensor([list(range(7)) + [8]])
    close(out.logits[0, 2], reference(hf, prefix + [a, c], position_ids=positions)[-1])


@torch.no_grad()
def test_same_input_gives_bit_identical_logits(hf_factory):
    model, _ = from_transformers(hf_factory("qwen2-tied", dtype=torch.float32))
    gen = torch.Generator().manual_seed(5)
    prompt, step = random_tokens(gen, 2, 9), random_tokens(gen, 2, 4)
    runs = []
    for _ in range(3):
        cache = model.new_cache(slots=2, max_len=32)
        first = model(prompt, cache).logits
        runs.append(torch.cat([first, model(step, cache).logits], dim=1))
    assert runs[0].dtype == torch.float32
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("head_dim", [48, 64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_rope_lookup_gives_the_bits_rope_tables_computes(head_dim, dtype):
    """Passes read cos and sin from tables made once (rope_lookup); every entry must be the one
    rope_tables computes for that pass alone, whatever the pass's width and rows, or logits would
    change with the table."""
    from specdraft.runner.model import rope_lookup, rope_tables

    g = torch.Generator().manual_seed(head_dim)
    for theta in (10_000.0, 500_000.0):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        for width in (1, 2, 3, 5, 16):
            positions = torch.randint(0, 4000, (3, width), generator=g)
            for computed, looked_up in zip(rope_tables(inv_freq, positions, dtype),
                                           rope_lookup(inv_freq, positions, dtype, 4096)):
                assert looked_up.dtype == dtype and looked_up.shape == (3, 1, width, head_dim)
                assert torch.equal(computed, looked_up), (theta, width)
