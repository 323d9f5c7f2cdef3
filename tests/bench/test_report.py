"""Bench arithmetic on synthetic records."""

from __future__ import annotations

import math

import pytest

from specdraft.bench.report import RunRecord, expected_tokens_per_round, markdown, summarize


def rec(method, qid, cat, tokens, time, ids=None, drafted=0, accepted=0, passes=None, dpp=(), app=(),
        draft_t=0.0, verify_t=None):
    return RunRecord(method, qid, cat, tokens, time, list(ids or range(tokens)), drafted, accepted,
                     tokens if passes is None else passes, list(dpp), list(app), draft_t,
                     time if verify_t is None else verify_t)


@pytest.fixture
def records():
    return [
        rec("plain", 1, "a", 10, 1.0),
        rec("plain", 2, "b", 10, 2.0),
        rec("fast", 1, "a", 10, 0.5, drafted=8, accepted=6, passes=4, dpp=[4, 4], app=[4, 2], draft_t=0.05, verify_t=0.4),
        rec("fast", 2, "b", 10, 1.0, ids=[9] * 10, drafted=4, accepted=1, passes=9, dpp=[4], app=[1], draft_t=0.1, verify_t=0.8),
        RunRecord("peer", 1, "a", 10, 2.0, list(range(10))),
        RunRecord("peer", 2, "b", 10, 4.0, list(range(10))),
    ]


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.5, 4) == pytest.approx((1 - 0.5 ** 5) / 0.5)
    assert expected_tokens_per_round(1.0, 3) == 4.0
    assert expected_tokens_per_round(0.7, 0) == 1.0
    assert expected_tokens_per_round(0.0, 5) == 1.0


def test_speedup_is_ratio_of_summed_times(records):
    s = summarize(records)
    assert s["fast"]["a"]["speedup"] == pytest.approx(2.0)
    assert s["fast"]["b"]["speedup"] == pytest.approx(2.0)
    assert s["fast"]["overall"]["speedup"] == pytest.approx(3.0 / 1.5)
    assert s["peer"]["overall"]["speedup"] == pytest.approx(0.5)
    assert s["plain"]["overall"]["tokens_per_second"] == pytest.approx(20 / 3.0)


def test_acceptance_and_positions(records):
    o = summarize(records)["fast"]["overall"]
    assert o["acceptance_rate"] == pytest.approx(7 / 12)
    assert o["acceptance_by_position"] == pytest.approx([5 / 8, 2 / 4])
    assert o["tokens_per_pass"] == pytest.approx(20 / 13)
    assert o["mean_draft_length"] == pytest.approx(12 / 13)
    assert o["time_split"]["drafting"] == pytest.approx(0.15 / 1.5)
    assert o["time_split"]["verifying"] == pytest.approx(1.2 / 1.5)
    assert o["time_split"]["other"] == pytest.approx(0.15 / 1.5)


def test_theoretical_speedup_and_efficiency(records):
    a = summarize(records)["fast"]["a"]
    plain_step = 1.0 / 10  # plain: verify time / passes in category a
    round_cost = (0.05 + 0.4) / 4 / plain_step
    theory = expected_tokens_per_round(6 / 8, 8 / 4) / round_cost
    assert a["round_cost_in_plain_steps"] == pytest.approx(round_cost)
    assert a["theoretical_speedup"] == pytest.approx(theory)
    assert a["efficiency"] == pytest.approx(2.0 / theory)


def test_mismatches_are_counted_against_plain(records):
    s = summarize(records)
    assert s["fast"]["a"]["mismatches"] == 0
    assert s["fast"]["b"]["mismatches"] == 1
    assert s["fast"]["overall"]["mismatches"] == 1
    assert s["plain"]["overall"]["mismatches"] == 0


def test_peers_have_no_speculation_metrics_and_markdown_renders(records):
    s = summarize(records)
    assert "acceptance_rate" not in s["peer"]["overall"]
    md = markdown(s, {"model": "tiny"})
    assert "| fast | 13.3 | 2.00x | 0.58 |" in md
    assert "| peer |" in md and "- model: tiny" in md
    assert not any(isinstance(v, float) and math.isnan(v) for v in s["fast"]["overall"].values())
