"""The engine's observers (``Engine.observers``, :mod:`specdraft.engine.report`): a report per
round, per prefill pass and per leaving sequence, counted against a drafter whose acceptance is
known, seen before the round's tokens reach their readers, and harmless when an observer fails."""

from __future__ import annotations

import logging
import threading

import pytest

from specdraft import SpeculativeDecoder
from specdraft.engine.report import kv_cache_usage
from specdraft.testing import repetitive_prompts
from specdraft.testing.drafters import RightThenWrong


class Recorder:
    """An observer keeping every report."""

    def __init__(self):
        self.reports = []

    def __call__(self, report):
        self.reports.append(report)

    def rows(self, kind, seq_id):
        return [r for rep in self.reports if rep.kind == kind for r in rep.rows if r.seq.id == seq_id]


@pytest.fixture
def decoder(tiny_model):
    dec = SpeculativeDecoder(tiny_model, None, drafter=RightThenWrong(tiny_model, right=1), spec_length=3, adaptive=False)
    yield dec
    dec.close()


def test_each_round_reports_what_each_row_drafted_accepted_and_committed(decoder):
    recorder = Recorder()
    decoder.engine.observers.append(recorder)
    prompts = repetitive_prompts(64)[:3]
    streams = [decoder.stream_ids(p, max_new_tokens=12) for p in prompts]
    results = []
    for stream in streams:
        list(stream)
        results.append(stream.result)
    for stream, prompt, result in zip(streams, prompts, results):
        seq = stream.seq
        rounds = recorder.rows("round", seq.id)
        # 12 tokens, 2 a round: left before each round 11, 9, 7, 5, 3, 1 caps the draft at 3, ..., 3, 1
        assert [r.drafted for r in rounds] == [3, 3, 3, 3, 3, 1]
        assert [r.depth for r in rounds] == [3, 3, 3, 3, 3, 1]
        assert [r.accepted for r in rounds] == [1] * 6 and [r.committed for r in rounds] == [2] * 6
        assert [r.accepted_per_position for r in rounds] == [[1, 0, 0]] * 5 + [[1]]
        assert not any(r.predicted for r in rounds)
        assert sum(r.committed for r in rounds) == len(result.token_ids) == 12
        assert sum(r.drafted for r in rounds) == result.stats.drafted_tokens
        assert sum(r.accepted for r in rounds) == result.stats.accepted_tokens
        assert len(rounds) == result.stats.target_passes
        assert rounds[0].first and rounds[0].gap is None
        assert all(not r.first and r.gap >= 0 for r in rounds[1:])
        assert sum(r.prefilled for r in recorder.rows("prefill", seq.id)) == len(prompt) - 1
        finish = [rep for rep in recorder.reports if rep.kind == "finish" and rep.rows[0].seq is seq]
        assert len(finish) == 1 and finish[0].reason == "length"
        assert seq.submitted <= seq.admitted <= seq.first_token <= seq.last_token
    for report in recorder.reports:
        assert report.draft_s >= 0 and report.verify_s >= 0 and report.prefill_s >= 0
        if report.kind == "round":
            assert report.tokens == sum(r.committed for r in report.rows) and report.batch_size == len(report.rows)
    # every sequence's reports: its prefill passes, then its rounds, then its finish
    for stream in streams:
        kinds = [rep.kind for rep in recorder.reports if any(r.seq is stream.seq for r in rep.rows)]
        assert kinds == sorted(kinds, key=["prefill", "round", "finish"].index) and kinds[-1] == "finish"


def test_a_reader_finds_what_it_got_counted_already(decoder):
    """A round's observers run before its tokens are sent: at every burst a reader receives, an
    observer has counted at least the tokens received so far."""
    counted: dict[int, int] = {}

    def count(report):
        for row in report.rows:
            counted[row.seq.id] = counted.get(row.seq.id, 0) + row.committed

    held, go = threading.Event(), threading.Event()

    def hold_first(report):  # the engine waits inside its first round's report
        if report.kind == "round" and not held.is_set():
            held.set()
            go.wait(30)

    decoder.engine.observers.extend([count, hold_first])
    stream = decoder.stream_ids(repetitive_prompts(64)[0], max_new_tokens=20)
    assert held.wait(30)
    try:
        assert stream.seq.events.empty() and counted[stream.seq.id] == 2  # counted, not sent yet
    finally:
        go.set()
    received = 0
    for chunk in stream:
        received += len(chunk.token_ids)
        assert counted[stream.seq.id] >= received
    assert received == counted[stream.seq.id] == 20


def test_an_observer_that_fails_is_logged_once_and_changes_nothing(decoder, caplog):
    prompt = repetitive_prompts(64)[1]
    expected = decoder.generate_ids([prompt], max_new_tokens=10)[0].token_ids
    recorder = Recorder()

    def broken(report):
        raise RuntimeError("boom")

    decoder.engine.observers.extend([broken, recorder])
    with caplog.at_level(logging.ERROR, logger="specdraft.engine"):
        got = decoder.generate_ids([prompt, prompt], max_new_tokens=10)
    assert [r.token_ids for r in got] == [expected, expected]
    assert len([r for r in caplog.records if "observer" in r.getMessage()]) == 1
    assert sum(r.committed for rep in recorder.reports for r in rep.rows) == 20  # the others still hear everything


def test_an_aborted_sequence_reports_its_tokens_once_and_leaves(decoder):
    recorder = Recorder()
    gate, reached = threading.Event(), threading.Event()

    def hold(report):  # after the 3rd round: the reader stops the request while the engine waits
        if report.kind == "round" and sum(rep.kind == "round" for rep in recorder.reports) == 3:
            reached.set()
            gate.wait(30)

    decoder.engine.observers.extend([recorder, hold])
    stream = decoder.stream_ids(repetitive_prompts(64)[2], max_new_tokens=60)
    assert reached.wait(30)
    usage = kv_cache_usage(decoder.engine)
    stream.close()
    gate.set()
    list(stream)
    seq = stream.seq
    finish = [rep for rep in recorder.reports if rep.kind == "finish"]
    assert [(rep.rows[0].seq, rep.reason) for rep in finish] == [(seq, "aborted")]
    assert sum(r.committed for r in recorder.rows("round", seq.id)) == len(seq.new_tokens) == 6
    cache, memory = decoder.engine.runner.cache, decoder.engine.memory  # its reservation: one row of all it may write
    assert usage == pytest.approx(cache.bytes_for(1, seq.max_len + memory.widest + 1) / memory.budget)
    assert 0 < usage <= 1
    assert kv_cache_usage(decoder.engine) == 0.0  # nobody runs


def test_rounds_without_drafts(tiny_model):
    """The ``none`` drafter: every round a plain step of one token per row, nothing drafted."""
    recorder = Recorder()
    with SpeculativeDecoder(tiny_model, None, drafter="none") as dec:
        dec.engine.observers.append(recorder)
        result = dec.generate_ids([repetitive_prompts(64)[0]], max_new_tokens=5)[0]
    rounds = [r for rep in recorder.reports if rep.kind == "round" for r in rep.rows]
    assert [(r.committed, r.drafted, r.accepted, r.accepted_per_position) for r in rounds] == [(1, 0, 0, [])] * 5
    assert len(result.token_ids) == 5
