"""The target's KV cache under a memory bound (:mod:`specdraft.engine.memory`): sized by use, within it.

A decoder whose bound fits two rows of its longest request runs four requests two at a time and
gives plain decoding's outputs (unbounded), token for token (float64, and
bfloat16 on a model wide enough that rounding follows a pass's shape), through rows that are
reallocated as sequences grow, join and leave, with drafts refused and rolled back and with
EAGLE trees; at every report the cache's buffers stay within the bound. A cache grows with the
tokens in use (rows for the sequences running, a row as long as the longest needs now), gives
memory back when idle, and a request that could never fit is refused in one line with nothing
queued.
"""

from __future__ import annotations

import pytest
import torch

from specdraft import ConfigError, SpeculativeDecoder
from specdraft.engine.memory import check_kv_memory
from specdraft.testing import random_heads, tiny_llama, wide_bf16_llama

NEW = 220  # tokens each request may generate: rows grow past their first capacity


@pytest.fixture(scope="module")
def models():
    return {"float64": tiny_llama(vocab_size=64, seed=0, max_positions=512), "bfloat16": wide_bf16_llama()}


def _prompts(vocab: int) -> list[list[int]]:
    """Four prompts of different lengths, repetitive enough that prompt lookup drafts (and is refused)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(4, vocab, (7,), generator=g).tolist() * 9)[:n] for n in (5, 40, 60, 17)]


def _decoder(model, drafter="prompt-lookup", tmp_path=None, **kwargs):
    options = None
    if drafter == "eagle-tree":
        random_heads("eagle", model, tmp_path)
        drafter, options = "eagle", {"heads": str(tmp_path), "min_confidence": 0.0, "tree_budget": 6}
    return SpeculativeDecoder(model, None, drafter=drafter, drafter_options=options, spec_length=3, adaptive=False,
                              max_batch=4, prefill_chunk=8, **kwargs)


def _watch(decoder) -> list[tuple[int, int, int]]:
    """(sequences running, a row's capacity, cache bytes) at every report of ``decoder``'s engine."""
    seen, cache = [], decoder.runner.cache
    decoder.observe(lambda report: seen.append((len(decoder.engine.scheduler.running), cache.kv.max_len,
                                                cache.nbytes)))
    return seen


def _idle(decoder) -> None:
    """Wait for the engine's step to end (a result is complete before its step is)."""
    with decoder._loop.step_lock:
        pass


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("drafter", ["prompt-lookup", "eagle-tree"])
def test_two_rows_of_memory_run_four_requests_two_at_a_time_with_the_same_outputs(models, dtype, drafter, tmp_path):
    model = models[dtype]
    prompts = _prompts(model.config.vocab_size)
    plain = _decoder(model, "none")  # unbounded in effect: 4 GiB
    expected = plain.generate_ids(prompts, max_new_tokens=NEW)
    widest = plain.engine.memory.widest  # the widest pass any drafter here makes (a prediction, 32)
    budget = plain.runner.cache.bytes_for(2, max(len(p) for p in prompts) + NEW + widest + 1)
    bounded = _decoder(model, drafter, tmp_path, prefix_caching=False, kv_cache_memory=budget)
    seen = _watch(bounded)
    results = bounded.generate_ids(prompts, max_new_tokens=NEW)
    for p, a, b in zip(prompts, expected, results):
        assert len(b.token_ids) == NEW
        assert a.token_ids == b.token_ids, f"prompt of {len(p)} tokens"
    assert max(running for running, _, _ in seen) == 2  # the bound, not max_batch (4), decided
    assert all(nbytes <= budget for _, _, nbytes in seen)
    capacities = [n for _, n, _ in seen]
    assert capacities[0] < max(capacities)  # rows reallocated as they grew, keeping what they held
    assert sum(r.stats.drafted_tokens - r.stats.accepted_tokens for r in results) > 0  # refused: rolled back
    assert drafter != "prompt-lookup" or sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_seeded_sampling_through_reallocated_rows_is_bit_for_bit_the_unbounded_runs(models, dtype):
    """Sampled output depends on each sequence's own seed and tokens only: under two rows of memory
    (waiting, reallocating) it is the unbounded decoder's bit for bit; its law is plain
    sampling's by the engine's chi-square tests (tests/engine/test_continuous.py)."""
    model = models[dtype]
    prompts = _prompts(model.config.vocab_size)
    params = {"max_new_tokens": NEW, "temperature": 0.8, "seed": 7}
    free = _decoder(model, prefix_caching=False)
    expected = [r.token_ids for r in free.generate_ids(prompts, **params)]
    budget = free.runner.cache.bytes_for(2, max(len(p) for p in prompts) + NEW + free.engine.memory.widest + 1)
    bounded = _decoder(model, prefix_caching=False, kv_cache_memory=budget)
    seen = _watch(bounded)
    assert [r.token_ids for r in bounded.generate_ids(prompts, **params)] == expected
    assert max(running for running, _, _ in seen) == 2


def test_the_cache_grows_with_the_tokens_in_use_and_gives_memory_back(models):
    model = models["float64"]
    decoder = SpeculativeDecoder(model, None, drafter="prompt-lookup", spec_length=3, max_batch=8)
    cache = decoder.runner.cache
    shapes: list[tuple[int, int]] = []
    decoder.observe(lambda report: shapes.append((cache.kv.slots, cache.kv.max_len)))
    prompt = _prompts(64)[0]
    reserved = cache.rounded(len(prompt) + 400 + decoder.engine.memory.widest + 1)
    [result] = decoder.generate_ids([prompt], max_new_tokens=400)
    assert len(result.token_ids) == 400
    assert {rows for rows, _ in shapes} == {1}  # one request: one row, not max_batch
    lengths = [n for _, n in shapes]
    assert lengths[0] < reserved and lengths == sorted(lengths) and lengths[-1] == reserved  # grown as it went
    shapes.clear()
    decoder.generate_ids(_prompts(64), max_new_tokens=300)
    assert max(rows for rows, _ in shapes) == 4  # rows for the sequences running
    _idle(decoder)
    # idle, holding over 4x what one short row needs: memory back
    assert (cache.kv.slots, cache.kv.max_len) == (1, cache.rounded(0))


def test_a_request_that_could_never_fit_is_refused_in_one_line_and_nothing_is_queued(models):
    model = models["float64"]
    probe = _decoder(model)
    widest = probe.engine.memory.widest
    budget = probe.runner.cache.bytes_for(1, 10 + 100 + widest + 1)
    decoder = _decoder(model, kv_cache_memory=budget)
    prompt = _prompts(64)[1][:10]
    with pytest.raises(ConfigError) as caught:
        decoder.generate_ids([prompt], max_new_tokens=1000)
    message = str(caught.value)
    assert "\n" not in message and "of KV cache" in message and "kv_cache_memory" in message
    assert caught.value.param == "max_new_tokens"  # the server names the request's own field
    assert decoder.num_waiting == 0 and decoder.num_running == 0
    [ok] = decoder.generate_ids([prompt], max_new_tokens=20)  # the decoder goes on
    assert ok.token_ids == _decoder(model, "none").generate_ids([prompt], max_new_tokens=20)[0].token_ids


@pytest.mark.parametrize("bad, says", [(0, "more than 0"), ("lots", "must be a size"), (-1, "must be a size"),
                                       (True, "must be a size")])
def test_bad_kv_cache_memory_is_refused_naming_it(models, bad, says):
    with pytest.raises(ConfigError, match=says) as caught:
        _decoder(models["float64"], kv_cache_memory=bad)
    assert caught.value.param == "kv_cache_memory"
    assert check_kv_memory("2GiB") == 2 << 30
