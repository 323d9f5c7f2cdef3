"""Chunked prefill: a long prompt joins a running batch without stalling it.

Counted, not timed: while a newcomer's prompt is prefilled, every step prefills at most one
chunk of it (``prefill_chunk`` tokens) and every running sequence still gets its round, so the
gap a newcomer puts between two of a running sequence's rounds is one chunk's pass."""

from __future__ import annotations

import math

import pytest

from specdraft import GenerationSettings, SpeculativeDecoder
from specdraft.engine.sequence import Sequence
from specdraft.errors import ConfigError
from specdraft.testing import plain_greedy, random_heads, repetitive_prompts

CHUNK = 16


def _decoder(tiny_model, drafter, tmp_path, chunk=CHUNK):
    options = None
    if drafter == "eagle":  # needs the target's hidden states of the prompt: handed over once its prefill ends
        random_heads("eagle", tiny_model, tmp_path)
        options = {"heads": str(tmp_path), "min_confidence": 0.0}
    return SpeculativeDecoder(tiny_model, None, drafter=drafter, spec_length=3, drafter_options=options,
                              adaptive=False, max_batch=2, prefill_chunk=chunk)


def _record_chunks(engine) -> dict:
    """Wrap the engine's prefill passes: ``{sequence id: [(step, start, end), ...]}``."""
    chunks: dict = {}
    original = engine._prefill_chunk

    def recording(s, end):
        chunks.setdefault(s.id, []).append((engine.steps, s.cached, end))
        original(s, end)

    engine._prefill_chunk = recording
    engine.steps = 0
    return chunks


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_a_long_prompt_joins_in_chunks_while_the_running_sequence_decodes_every_step(tiny_model, drafter, tmp_path):
    base = repetitive_prompts(64)
    long = (base[0] * 60)[:101]  # 100 tokens to prefill: 7 chunks of 16 (the last of 4)
    dec = _decoder(tiny_model, drafter, tmp_path)
    engine = dec.engine
    chunks = _record_chunks(engine)
    first = Sequence(tokens=list(base[1]), settings=GenerationSettings(max_new_tokens=60), max_len=256, seed=0)
    engine.add([first])
    for _ in range(2):
        engine.steps += 1
        engine.step()
    second = Sequence(tokens=list(long), settings=GenerationSettings(max_new_tokens=20), max_len=256, seed=1)
    engine.add([second])
    steps_prefilling = 0
    while True:
        before = len(first.tokens)
        engine.steps += 1
        engine.step()
        assert len(first.tokens) > before, "the running sequence lost a round to the newcomer's prefill"
        steps_prefilling += 1
        if not second.prefilling:
            break
    # one chunk a step, at offsets the prompt alone fixes
    expected = [(0, 16), (16, 32), (32, 48), (48, 64), (64, 80), (80, 96), (96, 100)]
    assert [(a, b) for _, a, b in chunks[second.id]] == expected
    assert [step for step, _, _ in chunks[second.id]] == list(range(3, 3 + len(expected)))
    assert steps_prefilling == math.ceil(100 / CHUNK)
    while engine.has_work():
        engine.step()
    for seq in (first, second):
        assert seq.error is None, seq.error
        assert seq.new_tokens == plain_greedy(tiny_model, seq.tokens[: seq.prompt_len], len(seq.new_tokens))
    dec.close()


def test_a_prompt_alone_is_prefilled_at_the_same_offsets_a_chunk_a_step(tiny_model, tmp_path):
    """Nobody decoding: still one chunk a step (a newcomer may come), at the same offsets (the
    chunks, and so the numbers, do not depend on whether anyone else was running)."""
    long = (repetitive_prompts(64)[3] * 20)[:101]
    dec = _decoder(tiny_model, "ngram", tmp_path)
    chunks = _record_chunks(dec.engine)
    seq = Sequence(tokens=list(long), settings=GenerationSettings(max_new_tokens=8), max_len=256, seed=0)
    dec.engine.add([seq])
    while seq.prefilling:
        dec.engine.steps += 1
        dec.engine.step()
    assert [(a, b) for _, a, b in chunks[seq.id]] == [(i, min(i + CHUNK, 100)) for i in range(0, 100, CHUNK)]
    assert [step for step, _, _ in chunks[seq.id]] == list(range(1, 8)) and len(seq.new_tokens) >= 1
    while dec.engine.has_work():
        dec.engine.step()
    assert seq.new_tokens == plain_greedy(tiny_model, long, 8)


def test_a_request_arriving_during_a_long_prefill_waits_one_chunk_not_the_rest(tiny_model, tmp_path):
    """A long prompt on an idle engine; a short request arrives during its first pass (issue 47:
    the short one waited for all of the long prefill, 30 s on the default model for 8,150
    tokens). Counted, not timed: between its arrival and its first token the engine runs no
    more of the long prompt than the pass it was in, and then the short prompt's own; both
    outputs are plain decoding's."""
    long = (repetitive_prompts(64)[3] * 20)[:101]
    short = repetitive_prompts(64)[1][:9]
    dec = _decoder(tiny_model, "ngram", tmp_path)
    engine = dec.engine
    passes: list[tuple[str, int, int]] = []
    first = Sequence(tokens=list(long), settings=GenerationSettings(max_new_tokens=8), max_len=256, seed=0)
    second = Sequence(tokens=list(short), settings=GenerationSettings(max_new_tokens=8), max_len=256, seed=1)
    original = engine._prefill_chunk

    def recording(s, end):
        passes.append(("long" if s is first else "short", s.cached, end))
        original(s, end)
        if len(passes) == 1:  # arrives while the long prompt's first pass runs
            engine.add([second])
            passes.append(("arrived", 0, 0))

    engine._prefill_chunk = recording
    engine.add([first])
    while not second.new_tokens:
        engine.step()
    arrived = passes.index(("arrived", 0, 0))
    assert passes[arrived + 1 :] == [("short", 0, 8)]  # nothing of the long prompt in between
    while engine.has_work():
        engine.step()
    assert first.new_tokens == plain_greedy(tiny_model, long, 8)
    assert second.new_tokens == plain_greedy(tiny_model, short, 8)


def test_a_long_prompt_is_not_starved_by_short_ones_arriving_every_step(tiny_model, tmp_path):
    """Short prompts go first, but a long prompt ages: with a new short request every step (each
    filling the step's budget with its own pass), the long one still finishes its prefill in a
    bounded number of steps (about twice its chunks), not never."""
    long = (repetitive_prompts(64)[3] * 20)[:101]  # 7 chunks of 16
    short = repetitive_prompts(64)[1][:9]
    dec = SpeculativeDecoder(tiny_model, None, drafter="ngram", spec_length=3, adaptive=False, max_batch=8,
                             prefill_chunk=CHUNK, prefix_caching=False)
    engine = dec.engine
    first = Sequence(tokens=list(long), settings=GenerationSettings(max_new_tokens=4), max_len=256, seed=0)
    engine.add([first])
    steps = 0
    while first.prefilling:
        engine.add([Sequence(tokens=list(short), settings=GenerationSettings(max_new_tokens=1), max_len=256,
                             seed=steps + 1)])
        engine.step()
        steps += 1
        assert steps <= 16, "the long prompt is starved"
    while engine.has_work():
        engine.step()
    assert first.new_tokens == plain_greedy(tiny_model, long, 4)


def test_chunking_off_prefills_each_prompt_in_one_pass(tiny_model, tmp_path):
    long = (repetitive_prompts(64)[0] * 60)[:101]
    dec = _decoder(tiny_model, "ngram", tmp_path, chunk=0)
    chunks = _record_chunks(dec.engine)
    out = dec.generate_ids([long], max_new_tokens=6)[0]
    assert [(a, b) for (_, a, b) in next(iter(chunks.values()))] == [(0, 100)]
    assert out.token_ids == plain_greedy(tiny_model, long, 6)


@pytest.mark.parametrize("bad", [-1, 2.5, "256", True])
def test_a_bad_chunk_size_is_one_config_error(tiny_model, bad):
    with pytest.raises(ConfigError, match="prefill_chunk must be an integer >= 0"):
        SpeculativeDecoder(tiny_model, None, drafter="ngram", prefill_chunk=bad)


def test_choices_of_one_prompt_prefill_it_once(tiny_model, tmp_path):
    """``n`` sequences of one prompt (a request's choices): the first prefills it, the others copy
    its passes from the prefix cache; greedy choices all equal plain decoding, seeded sampled ones are reproducible
    and draw their own random numbers (distinct)."""
    from specdraft.engine.sequence import sequences_for

    long = (repetitive_prompts(64)[0] * 60)[:101]
    dec = _decoder(tiny_model, "eagle", tmp_path)
    chunks = _record_chunks(dec.engine)
    greedy = sequences_for([long], GenerationSettings(max_new_tokens=12, n=3), 256)
    dec.engine.add(greedy)
    while dec.engine.has_work():
        dec.engine.step()
    # the first prefills (7 chunks of 16), the second copies; the third waits for a slot (2), by
    # when its siblings have left: it copies from the prefix cache too
    assert [len(chunks.get(s.id, [])) for s in greedy] == [7, 0, 0]
    assert [s.stats.cached_tokens for s in greedy] == [0, 100, 100]
    plain = plain_greedy(tiny_model, long, 12)
    assert all(s.error is None and s.new_tokens == plain for s in greedy)

    def sampled(seed):
        seqs = sequences_for([long], GenerationSettings(max_new_tokens=12, temperature=1.0, seed=seed, n=3), 256)
        dec.engine.add(seqs)
        while dec.engine.has_work():
            dec.engine.step()
        return [s.new_tokens for s in seqs]

    first = sampled(5)
    assert sampled(5) == first and len({tuple(t) for t in first}) == 3
    dec.close()


def test_generate_with_n_gives_each_prompts_choices_in_order(tiny_model):
    prompts = [repetitive_prompts(64)[0], repetitive_prompts(64)[1]]
    dec = SpeculativeDecoder(tiny_model, None, drafter="ngram", spec_length=3, max_batch=4)
    greedy = dec.generate_ids(prompts, max_new_tokens=6, n=2)
    assert [r.token_ids for r in greedy] == [plain_greedy(tiny_model, p, 6) for p in prompts for _ in range(2)]
    sampled = dec.generate_ids(prompts, max_new_tokens=6, n=2, temperature=1.0, seed=3)
    one = dec.generate_ids(prompts, max_new_tokens=6, temperature=1.0, seed=3)
    # choice 0 of each prompt is what n=1 gives with the same seed; choice 1 draws its own numbers
    assert [r.token_ids for r in sampled[::2]] == [r.token_ids for r in one]
    assert sampled[0].token_ids != sampled[1].token_ids and sampled[2].token_ids != sampled[3].token_ids
    streams = dec.stream_ids(prompts[0], max_new_tokens=6, n=3)
    assert len(streams) == 3
    assert [[t for chunk in s for t in chunk.token_ids] for s in streams] == [plain_greedy(tiny_model, prompts[0], 6)] * 3
    for bad in (0, 129, True, 2.0):
        with pytest.raises(ConfigError, match="n must be an integer from 1 to 128"):
            dec.generate_ids(prompts, max_new_tokens=2, n=bad)
    with pytest.raises(ConfigError, match="prediction works with n=1 only"):
        dec.generate_ids(prompts[:1], max_new_tokens=2, n=2, prediction=[[5, 6]])
    dec.close()
