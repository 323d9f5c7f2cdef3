"""Drafter API version 1 under the continuous-batching engine: it runs in waves, exactly.

A version-1 drafter (written before continuous batching) keeps state by row index and forgets
it at ``reset()``. The engine runs it in waves: a wave starts together after one ``reset()``,
its rows keep their index until all of them have finished, and nothing joins meanwhile.
"""

from __future__ import annotations

from specdraft import Draft, Drafter, SpeculativeDecoder
from specdraft.drafters.api import prompt_lookup
from specdraft.testing import check_continuous_batching, plain_greedy, repetitive_prompts


class RowLookupDrafter(Drafter):
    """The example plugin as it was before API version 2: a draft length per row index, grown
    after fully accepted rounds and shrunk after rejections; records what the engine does.
    Version 1 was the default then; such a drafter now declares it (docs/writing-a-drafter.md)."""

    api_version = 1

    def reset(self) -> None:
        self.lengths: dict[int, int] = {}  # row -> current draft length
        self.waves = getattr(self, "waves", -1) + 1  # resets after the one at construction
        self.rounds = getattr(self, "rounds", [])  # (wave, seq_ids, active) per propose

    def propose(self, ctx, k):
        self.rounds.append((self.waves, list(ctx.seq_ids), list(ctx.active)))
        rows = []
        for b, tokens in enumerate(ctx.token_ids):
            want = min(k, self.lengths.setdefault(b, 3))
            rows.append(prompt_lookup(tokens, want, 1, 3) if ctx.active[b] else [])
        return Draft.from_lists(rows, device=ctx.device)

    def on_verified(self, ctx, num_accepted):
        for b, (verified, accepted) in enumerate(zip(ctx.num_verified, num_accepted)):
            if verified:
                self.lengths[b] = min(self.lengths[b] + 2, 8) if accepted == verified else max(self.lengths[b] - 1, 1)


def _prompts():
    base = repetitive_prompts(64)
    return [base[0], base[1][:5], base[2] + base[3], base[3], base[1]]  # 17, 5, 8, 7 and 11 tokens


def test_version_1_drafter_runs_in_waves_with_greedy_parity(tiny_model):
    drafter = RowLookupDrafter(None, None)
    assert drafter.api_version == 1 and drafter.waves == 0
    dec = SpeculativeDecoder(tiny_model, None, drafter=drafter, spec_length=4, max_batch=2, adaptive=False)
    prompts = _prompts()
    results = dec.generate_ids(prompts, max_new_tokens=12)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(tiny_model, p, 12)
    assert drafter.waves == 3  # five sequences through two slots: 2 + 2 + 1, one reset() each
    waves: dict[int, list] = {}
    for wave, seq_ids, active in drafter.rounds:
        waves.setdefault(wave, []).append((seq_ids, active))
    assert sorted(waves) == [1, 2, 3]
    members = [seq_ids for wave in sorted(waves) for seq_ids, _ in waves[wave][:1]]
    assert [len(m) for m in members] == [2, 2, 1]
    assert len({i for m in members for i in m}) == 5  # every sequence in exactly one wave
    for wave in waves.values():  # rows keep their sequence for the whole wave
        assert all(seq_ids == wave[0][0] for seq_ids, _ in wave)


def test_version_1_drafter_sees_finished_rows_until_its_wave_ends(tiny_model):
    """Different budgets: the wave's shorter sequence finishes first and stays as an inactive
    row (its index does not move) while the other runs on; the next one waits for the wave."""
    drafter = RowLookupDrafter(None, None)
    dec = SpeculativeDecoder(tiny_model, None, drafter=drafter, spec_length=3, max_batch=2, adaptive=False)
    prompts, budgets = _prompts(), [4, 15, 9, 3, 6]
    with dec._loop.step_lock:  # every request waits before the first step: the waves are known
        streams = [dec.stream_ids(p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    for p, n, s in zip(prompts, budgets, streams):
        assert [t for chunk in s for t in chunk.token_ids] == plain_greedy(tiny_model, p, n)
    assert drafter.waves == 3
    ids = [s.seq.id for s in streams]
    first = [(seq_ids, active) for wave, seq_ids, active in drafter.rounds if wave == 1]
    assert all(seq_ids == ids[:2] for seq_ids, _ in first)
    assert first[0][1] == [True, True] and first[-1][1] == [False, True]  # the 4-token one finished first
    seen: set[int] = set()
    previous: list[int] = []
    for _, seq_ids, _ in drafter.rounds:
        assert seq_ids == previous or not set(seq_ids) & seen  # no joining mid-wave
        seen |= set(seq_ids)
        previous = seq_ids


def test_the_conformance_suite_runs_a_version_1_drafter_under_continuous_batching(tiny_model):
    drafter = RowLookupDrafter(None, None)
    check_continuous_batching(drafter, tiny_model, spec_length=4)
    assert drafter.waves >= 4  # eight requests through two slots
