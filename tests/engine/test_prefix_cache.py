"""Prefix caching (:mod:`specdraft.engine.prefix`): prompt passes kept across requests, outputs unchanged.

Every decoder here is compared with one that has no prefix cache: greedy outputs token for token
(float64, and bfloat16 on a model wide enough that a pass starting at another offset rounds
differently), seeded sampled outputs bit for bit, with drafts refused and rolled back, trees,
predictions and ``n`` choices, and under a memory bound small enough that blocks are evicted
while requests run; a chi-square test of sampling from cached prefixes; the index's own rules.
"""

from __future__ import annotations

import pytest
import torch

from specdraft import ConfigError, SamplingParams, SpeculativeDecoder
from specdraft.engine.prefix import PrefixCache, parse_memory, turn_ends, turn_mark
from specdraft.testing import SIGNIFICANCE, random_heads, tiny_llama, wide_bf16_llama
from specdraft.testing.stats import sampled_joint_pvalue

CHUNK = 8


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """A shared beginning of 29 tokens (a system prompt: 3 whole passes of 8 and part of a 4th),
    then tails of different lengths, repetitive enough that prompt lookup drafts; the last prompt
    repeats the first."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(4, vocab, (29,), generator=g).tolist()
    tails = [(torch.randint(4, vocab, (5,), generator=g).tolist() * 6)[:n] for n in (3, 14, 30)]
    prompts = [shared + t for t in tails]
    return prompts + [list(prompts[0])]


@pytest.fixture(scope="module")
def models():
    return {"float64": tiny_llama(vocab_size=64, seed=0), "bfloat16": wide_bf16_llama()}


def _decoder(model, drafter="prompt-lookup", tmp_path=None, **kwargs):
    options = None
    if drafter == "eagle-tree":  # the target's hidden states of the prompt: kept with the cached passes
        random_heads("eagle", model, tmp_path)
        drafter, options = "eagle", {"heads": str(tmp_path), "min_confidence": 0.0, "tree_budget": 6}
    return SpeculativeDecoder(model, None, drafter=drafter, drafter_options=options, spec_length=3, adaptive=False,
                              max_batch=4, prefill_chunk=CHUNK, **kwargs)


def _expected_hits(prompts: list[list[int]]) -> list[int]:
    """Tokens each prompt finds cached after the ones before it: its whole passes (offsets fixed
    by the prompt) that an earlier prompt also had, up to the first that differs."""
    def passes(p):
        return [tuple(p[i : min(i + CHUNK, len(p) - 1)]) for i in range(0, len(p) - 1, CHUNK)]

    hits, seen = [], set()
    for p in prompts:
        chain, n = (), 0
        for part in passes(p):
            chain += (part,)
            if chain not in seen:
                break
            n += len(part)
        seen |= {tuple(passes(p)[: i + 1]) for i in range(len(passes(p)))}
        hits.append(n)
    return hits


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("drafter", ["prompt-lookup", "eagle-tree"])
def test_greedy_output_is_the_same_from_cached_passes(models, dtype, drafter, tmp_path):
    """Prompts one after another (each finds what the ones before kept), then all at once (every
    pass cached): token for token what a decoder without the cache gives; drafts were refused
    (rollback) and accepted."""
    model = models[dtype]
    prompts = _prompts(model.config.vocab_size)
    plain = _decoder(model, "none", prefix_caching=False)
    expected = [r.token_ids for r in plain.generate_ids(prompts, max_new_tokens=24)]
    dec = _decoder(model, drafter, tmp_path)
    one_by_one = [dec.generate_ids([p], max_new_tokens=24)[0] for p in prompts]
    together = dec.generate_ids(prompts, max_new_tokens=24)
    assert [r.token_ids for r in one_by_one] == expected
    assert [r.token_ids for r in together] == expected
    assert [r.stats.cached_tokens for r in one_by_one] == _expected_hits(prompts) == [0, 24, 24, 31]
    assert [r.stats.cached_tokens for r in together] == [len(p) - 1 for p in prompts]
    stats = [r.stats for r in one_by_one + together]
    accepted = sum(s.accepted_tokens for s in stats)
    assert accepted < sum(s.drafted_tokens for s in stats)
    # random eagle heads on the wide bfloat16 model draft nothing it accepts: every draft rolled back
    assert accepted > 0 or (drafter, dtype) == ("eagle-tree", "bfloat16")


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_conversations_next_turn_finds_all_of_the_last_turns_prompt_cached(models, dtype):
    """A chat's turns, with a turn mark (a generation prompt ``1 2 3``: the mark is ``1 2``): each
    turn resends the conversation, and finds the whole of the last turn's prompt (but its last
    token) cached, not just its whole 8-token passes; token for token what a decoder without the
    cache gives, and what plain decoding gives."""
    model = models[dtype]
    g = torch.Generator().manual_seed(3)
    system = torch.randint(4, model.config.vocab_size, (29,), generator=g).tolist()
    messages = [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 3)]

    def turns(dec):
        prompt, got = list(system), []
        for message in messages:
            prompt += message + [1, 2, 3]
            [r] = dec.generate_ids([prompt], max_new_tokens=9)
            got.append((len(prompt), r.token_ids, r.stats.cached_tokens))
            prompt += r.token_ids + [0]  # the answer and its end, as the template renders them
        return got

    runs = {}
    for name, drafter, caching in (("plain", "none", False), ("off", "prompt-lookup", False),
                                   ("on", "prompt-lookup", True)):
        dec = _decoder(model, drafter, prefix_caching=caching)
        dec.engine.turn_mark = (1, 2)
        runs[name] = turns(dec)
    outputs = {name: [out for _, out, _ in got] for name, got in runs.items()}
    assert outputs["on"] == outputs["off"] == outputs["plain"]
    lengths = [n for n, _, _ in runs["on"]]
    # at fixed 8-token offsets alone the hits would be 32 and 56
    assert [hit for _, _, hit in runs["on"]] == [0, lengths[0] - 1, lengths[1] - 1]


def test_the_turn_mark_is_the_generation_prompt_but_its_last_token(smol_tokenizer):
    mark = turn_mark(smol_tokenizer)
    assert smol_tokenizer.decode(list(mark)) == "<|im_start|>assistant"  # ChatML's, then "\n"
    assert turn_ends([7, 1, 2, 3, 1, 2, 9, 1], (1, 2)) == [3, 6] and turn_ends([1, 2], ()) == []
    assert turn_mark(None) == ()


def test_predictions_and_choices_share_the_cached_prompt(models):
    """Predicted Outputs and ``n`` seeded sampled choices: bit for bit what a decoder without the
    cache gives; every choice after the first reads the whole prompt from the cache (what
    prefilling it once and copying it did before)."""
    model = models["float64"]
    prompts = _prompts(64)[:3]
    plain = _decoder(model, "none", prefix_caching=False).generate_ids(prompts, max_new_tokens=16)
    predictions = [r.token_ids[:6] + [1, 2] + r.token_ids[8:] for r in plain]  # right but for 2 tokens
    params = {"temperature": 0.8, "seed": 11, "n": 3, "max_new_tokens": 16}
    outputs = {}
    for caching in (False, True):
        dec = _decoder(model, "prompt-lookup", prefix_caching=caching)
        predicted = dec.generate_ids(prompts, max_new_tokens=16, prediction=predictions)
        sampled = dec.generate_ids(prompts, **params)
        outputs[caching] = ([r.token_ids for r in predicted], [r.token_ids for r in sampled])
        if caching:
            assert sum(r.stats.accepted_prediction_tokens for r in predicted) > 0
            assert [r.stats.cached_tokens for r in sampled] == [len(p) - 1 for p in prompts for _ in range(3)]
    assert outputs[True] == outputs[False]


def test_eviction_under_a_small_bound_keeps_outputs_exact(models):
    """Room for 3 passes: prompts that share beginnings in turn evict least recently used passes
    (never one another pass extends), and every output is still plain decoding's."""
    model = models["float64"]
    prompts = _prompts(64, seed=0) + _prompts(64, seed=1) + _prompts(64, seed=0)
    plain = _decoder(model, "none", prefix_caching=False)
    expected = [r.token_ids for r in plain.generate_ids(prompts, max_new_tokens=12)]
    token_bytes = plain.runner.cache.token_bytes
    dec = _decoder(model, "prompt-lookup", prefix_cache_memory=3 * CHUNK * token_bytes)
    results = [dec.generate_ids([p], max_new_tokens=12)[0] for p in prompts]
    assert [r.token_ids for r in results] == expected
    index = dec.engine.prefix
    assert index.stats.evicted_blocks > 0 and index.used <= 3 * CHUNK * token_bytes
    assert 0 < sum(r.stats.cached_tokens for r in results) < sum(_expected_hits(prompts))
    assert all(b.children == sum(c.parent is b for c in index.blocks.values()) for b in index.blocks.values())


def test_sampling_from_cached_passes_follows_the_target(small_vocab_model):
    """Every sample's prompt passes come from the cache (kept by a request before): the joint law
    of its first tokens against the target's, enumerated exactly (chi-square at SIGNIFICANCE)."""
    dec = SpeculativeDecoder(small_vocab_model, None, drafter="prompt-lookup", spec_length=3, adaptive=False,
                             max_batch=512, prefill_chunk=2)
    prompt = [3, 5, 3, 5, 3, 5, 3]
    dec.generate_ids([prompt], max_new_tokens=1)
    pvalue, results = sampled_joint_pvalue(dec, prompt, SamplingParams(temperature=1.0), seed=0)
    assert all(r.stats.cached_tokens == len(prompt) - 1 for r in results)
    assert sum(r.stats.accepted_tokens for r in results) > 0
    assert pvalue > SIGNIFICANCE


def test_off_and_bad_settings(tiny_model):
    assert _decoder(tiny_model, "none", prefix_caching=False).engine.prefix is None
    assert _decoder(tiny_model, "none", prefix_cache_memory=0).engine.prefix is None
    assert _decoder(tiny_model, "none", prefix_cache_memory="2MiB").engine.prefix.memory == 2 << 20
    assert parse_memory("1.5 GB") == 1_500_000_000 and parse_memory(4096) == 4096
    for bad in ("lots", "-1", "3 parsecs", True):
        with pytest.raises(ConfigError, match="prefix_cache_memory must be a size"):
            parse_memory(bad)
    with pytest.raises(ConfigError, match="prefix_caching must be True or False"):
        _decoder(tiny_model, "none", prefix_caching="yes")


class _Store:
    """A cache that records what the index asks of it."""

    def __init__(self):
        self.saved, self.dropped = {}, []

    def save_block(self, key, slot, start, end):
        self.saved[key] = (slot, start, end)

    def drop_block(self, key):
        self.dropped.append(key)
        del self.saved[key]


def test_the_index_keys_a_pass_by_everything_before_it_and_evicts_leaves_first():
    store = _Store()
    index = PrefixCache(store, memory=30, token_bytes=1)
    a = index.save(None, [1, 2, 3, 4], slot=0, start=0, hidden=None)
    b = index.save(a, [5, 6, 7, 8], slot=0, start=4, hidden=None)
    assert index.find(None, [1, 2, 3, 4]) is a and index.find(a, [5, 6, 7, 8]) is b
    assert index.find(None, [5, 6, 7, 8]) is None  # the same tokens after another beginning
    assert index.find(a, [5, 6, 7]) is None  # a pass is found whole or not at all
    assert index.save(None, [1, 2, 3, 4], 1, 0, None) is a and len(store.saved) == 2  # kept once
    index.find(None, [1, 2, 3, 4])  # a is now the most recently used, but b extends it
    c = index.save(None, list(range(20, 44)), 0, 0, None)  # 24 tokens: 8 + 24 > 30, one must go
    assert store.dropped == [b.id] and index.find(a, [5, 6, 7, 8]) is None
    assert c is not None and index.used == 28
    d = index.save(c, list(range(50, 56)), 0, 24, None)  # 6 more: a goes (c, d's parent, is kept)
    assert store.dropped == [b.id, a.id] and index.used == 30 and d is not None
    assert index.save(d, list(range(31)), 0, 30, None) is None  # never fits: nothing else evicted
    assert index.alive(c) and index.alive(d) and not index.alive(a)
    assert index.save(b, [9], 0, 8, None) is None  # after an evicted pass: not kept
