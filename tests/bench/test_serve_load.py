"""``specdraft bench-serve``: its arithmetic on made-up requests, and one tiny run end to end on
the default model (structure, completeness and the figures' arithmetic: no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from specdraft.bench.serve_load import (Request, compare_with_plain, conversations, inter_token_latencies, markdown,
                                        delta_text, request_body, requests_for, summarize_level)
from specdraft.cli import main


def test_inter_token_latency_divides_each_gap_by_the_chunks_tokens():
    req = Request(0, 1, "p", 8, sent=0.0, chunks=[(1.0, "a"), (1.5, "bb"), (1.6, "c")], done=1.7,
                  completion_tokens=8, target_passes=3, finish_reason="length")
    count = len  # one token per character: 4 tokens counted, scaled to the 8 the usage reports
    assert inter_token_latencies(req, count) == pytest.approx([0.5 / (2 * 2), 0.1 / (1 * 2)])
    row = summarize_level("none", 1, [req], 1.7, count)
    assert row["finished"] == 1 and row["output_tokens"] == 8 and row["tokens_per_pass"] == pytest.approx(8 / 3)
    assert row["ttft_ms"]["p50"] == pytest.approx(1000.0) and row["e2e_s"]["p50"] == pytest.approx(1.7)
    # the chunk gaps are the raw waits (0.5 s, 0.1 s), whatever the chunks carried
    assert row["gap_ms"] == pytest.approx({"p90": 460.0, "max": 500.0})
    assert "| 460 / 500 |" in markdown({"environment": {}, "load": [dict(row, speedup=1.0, mismatches=0)]})


def test_a_server_option_for_a_label_bench_serve_does_not_run_is_one_error(tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "chat", "turns": ["Hi."]}) + "\n")
    assert main(["bench-serve", "--questions", str(questions), "--drafters", "none,whole=none",
                 "--server-option", "hole:chunked-prefill-size=0", "--output", str(tmp_path / "o")]) == 2
    assert "--server-option names hole, which --drafters does not run" in capsys.readouterr().err


def test_speedup_and_mismatches_are_against_none_at_the_same_concurrency():
    def row(drafter, concurrency, tps, texts):
        return {"drafter": drafter, "concurrency": concurrency, "tokens_per_second": tps,
                "records": [{"index": i, "text": t, "error": None} for i, t in enumerate(texts)]}

    rows = [row("none", 1, 10.0, ["a", "b"]), row("pld", 1, 15.0, ["a", "x"]), row("pld", 4, 30.0, ["a"])]
    compare_with_plain(rows)
    assert rows[1]["speedup"] == pytest.approx(1.5) and rows[1]["mismatches"] == 1
    assert "speedup" not in rows[2]  # no plain row at concurrency 4


def test_prediction_tokens_are_summed_per_row_and_shown_as_accepted_over_rejected():
    def req(i, accepted, rejected):
        return Request(i, i, "p", 8, sent=0.0, chunks=[(0.5, "ab")], done=1.0, completion_tokens=2,
                       target_passes=1, accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected,
                       finish_reason="stop")

    row = summarize_level("pld", 1, [req(0, 5, 2), req(1, 3, 0), req(2, 0, 0)], 1.0, len)
    assert (row["accepted_prediction_tokens"], row["rejected_prediction_tokens"]) == (8, 2)
    assert [(r["accepted_prediction_tokens"], r["rejected_prediction_tokens"]) for r in row["records"]] == [
        (5, 2), (3, 0), (0, 0)]
    plain = summarize_level("none", 1, [req(0, 0, 0)], 1.0, len)
    table = markdown({"environment": {}, "load": [plain, row]})
    assert "| prediction accepted / rejected | mismatches |" in table
    assert "| 2.00 | - | - |" in table  # none: no prediction tokens; its mismatches not compared
    assert "| 2.00 | 8 / 2 | - |" in table


def test_the_body_carries_the_prediction_as_openai_predicted_outputs():
    body = request_body(Request(0, 1, "Fix the typo: teh cat", 16, prediction="the cat"))
    assert body["prediction"] == {"type": "content", "content": "the cat"}
    assert body["messages"] == [{"role": "user", "content": "Fix the typo: teh cat"}]
    assert (body["max_tokens"], body["temperature"], body["stream"]) == (16, 0, True)
    assert "prediction" not in request_body(Request(0, 1, "Say hello.", 16))


def test_the_body_carries_tools_and_calls_count_as_text():
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = request_body(Request(0, 1, "Call f.", 16, tools=tools, tool_choice="required"))
    assert body["tools"] == tools and body["tool_choice"] == "required"
    assert "tools" not in request_body(Request(0, 1, "Say hello.", 16))
    first = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    more = {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}
    assert [delta_text(d) for d in (first, more, {"content": "hi"}, {"role": "assistant"})] == ["f", '{"a": 1}', "hi", ""]


def test_plain_decoding_gets_no_prediction_and_the_drafters_do():
    questions = [{"question_id": 7, "prompt": "edit this", "prediction": "this"},
                 {"question_id": 8, "prompt": "say hello"},
                 {"question_id": 9, "prompt": "edit that", "prediction": "that"}]
    plain = requests_for("none", questions, 2, 32)
    drafter = requests_for("prompt-lookup", questions, 2, 32)
    assert [r.prediction for r in plain] == [None, None]
    assert [r.prediction for r in drafter] == ["this", None]  # the first n, in order
    for requests in (plain, drafter):
        assert [(r.index, r.question_id, r.prompt, r.max_tokens) for r in requests] == [
            (0, 7, "edit this", 32), (1, 8, "say hello", 32)]


@pytest.mark.e2e
@pytest.mark.server
def test_bench_serve_end_to_end(tmp_path, capsys):
    pytest.importorskip("fastapi", reason="bench-serve starts `specdraft serve`: pip install 'specdraft[serve]'")
    pytest.importorskip("httpx")
    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": 1, "category": "copy", "turns": ["Repeat exactly: red green blue red green blue"],
             "prediction": "red green blue red green blue"},
            {"question_id": 2, "category": "chat", "turns": ["Say hello."]}]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert main(["bench-serve", "--questions", str(questions), "--drafters", "none,prompt-lookup",
                 "--concurrency", "1,2", "--num-prompts", "2", "--max-tokens", "8", "--max-batch", "2",
                 "--fixed-batch", "2", "--output", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"environment", "load", "fixed_batch"}
    load = results["load"]
    assert [(r["drafter"], r["concurrency"]) for r in load] == [
        ("none", 1), ("prompt-lookup", 1), ("none", 2), ("prompt-lookup", 2)]
    plain = {r["concurrency"]: r for r in load if r["drafter"] == "none"}
    for r in load:
        assert r["requests"] == r["finished"] == 2 and not r["errors"]
        records = sorted(r["records"], key=lambda rec: rec["index"])
        assert [rec["index"] for rec in records] == [0, 1]
        for rec in records:  # cut by max_tokens at exactly 8 tokens, or stopped by the model after 1 to 8
            assert (rec["finish_reason"], rec["completion_tokens"]) == ("length", 8) or (
                rec["finish_reason"] == "stop" and 1 <= rec["completion_tokens"] <= 8)
            assert 1 <= rec["target_passes"] <= rec["completion_tokens"]  # a pass emits 1 token or more
            assert rec["ttft_s"] <= rec["e2e_s"] <= r["wall_s"]  # wall: first request sent to last answer
        # greedy: the same texts, so the same token counts, as plain decoding's
        assert r["mismatches"] == 0
        assert [rec["completion_tokens"] for rec in records] == [
            rec["completion_tokens"] for rec in sorted(plain[r["concurrency"]]["records"], key=lambda x: x["index"])]
        # the figures are the records' own arithmetic
        assert r["output_tokens"] == sum(rec["completion_tokens"] for rec in records)
        assert r["tokens_per_second"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["tokens_per_pass"] == pytest.approx(r["output_tokens"] / sum(rec["target_passes"] for rec in records))
        assert r["speedup"] == pytest.approx(r["tokens_per_second"] / plain[r["concurrency"]]["tokens_per_second"])
        assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"]
        predicted = [(rec["accepted_prediction_tokens"], rec["rejected_prediction_tokens"]) for rec in records]
        assert (r["accepted_prediction_tokens"], r["rejected_prediction_tokens"]) == tuple(map(sum, zip(*predicted)))
        if r["drafter"] == "none":  # plain decoding: one token per pass, its own baseline, and no prediction
            assert r["tokens_per_pass"] == 1.0 and r["speedup"] == pytest.approx(1.0)
            assert predicted == [(0, 0), (0, 0)]
        else:  # the prediction drafted (question 1, index 0: first in the round robin); question 2 has none
            assert sum(predicted[0]) > 0 and predicted[1] == (0, 0)
    fixed = results["fixed_batch"]
    assert [r["drafter"] for r in fixed["rows"]] == ["none", "prompt-lookup"]
    assert fixed["rows"][0]["output_tokens"] == fixed["rows"][1]["output_tokens"] >= fixed["requests"] == 2  # greedy
    for r in fixed["rows"]:
        assert r["mismatches"] == 0
        for mode in ("waves", "continuous"):  # each way ran twice, on the same tokens
            runs = r[mode]["runs_s"]
            assert len(runs) == 2 and r[mode]["time_s"] == pytest.approx(sum(runs) / 2)
            assert r[mode]["tokens_per_second"] == pytest.approx(2 * r["output_tokens"] / sum(runs))
    assert results["environment"]["predictions"].startswith("1 of 2 prompts carry a prediction")
    assert "| prompt-lookup | 2 | 2/2 |" in (out / "results.md").read_text()
    assert "| none | 1 | 2/2 |" in capsys.readouterr().out


def test_multi_turn_requests_are_a_conversation_per_question():
    questions = [{"question_id": 7, "prompt": "a", "turns": ["a", "b", "c"], "system": "S"},
                 {"question_id": 8, "prompt": "d", "turns": ["d", "e"]}]
    requests = requests_for("none", questions, 2, 16, multi_turn=True)
    assert [(r.index, r.question_id, r.turn, r.prompt, r.system) for r in requests] == [
        (0, 7, 0, "a", "S"), (1, 7, 1, "b", "S"), (2, 7, 2, "c", "S"), (3, 8, 0, "d", None), (4, 8, 1, "e", None)]
    assert [[r.index for r in c] for c in conversations(requests)] == [[0, 1, 2], [3, 4]]
    done = [Request(i, 7, "p", 8, sent=0.0, chunks=[(0.1 * (i + 1), "x")], done=1.0, completion_tokens=1,
                    finish_reason="stop", turn=i, prompt_tokens=100, cached_tokens=[0, 90, 60][i]) for i in range(3)]
    row = summarize_level("none", 1, done, 1.0, len)
    assert row["hit_rate"] == pytest.approx(150 / 200)  # from the second turn on
    assert row["first_turn_ttft_ms"]["p50"] == pytest.approx(100.0)
    assert row["later_turns_ttft_ms"]["p50"] == pytest.approx(250.0)
    assert "| none | 1 | 75.0% | 100 / 100 | 250 / 290 |" in markdown({"environment": {}, "load": [row]})


@pytest.mark.e2e
@pytest.mark.server
def test_bench_serve_multi_turn_with_and_without_the_prefix_cache(tmp_path):
    """Two turns after a system prompt of over 256 tokens: the second turn reads the first's whole
    passes from the cache (none's server), or not at all (the server with the cache off); the
    answers are the same."""
    pytest.importorskip("fastapi", reason="bench-serve starts `specdraft serve`: pip install 'specdraft[serve]'")
    questions = tmp_path / "q.jsonl"
    system = " ".join(f"Rule {i}: answer in a few words." for i in range(50))
    questions.write_text(json.dumps({"question_id": 1, "category": "multi-turn", "system": system,
                                     "turns": ["Name a colour.", "Name another one."]}) + "\n")
    out = tmp_path / "out"
    assert main(["bench-serve", "--questions", str(questions), "--drafters", "none,off=none", "--multi-turn",
                 "--server-option", "off:prefix-cache-memory=0", "--concurrency", "1", "--num-prompts", "1",
                 "--max-tokens", "4", "--output", str(out)]) == 0
    rows = {r["drafter"]: r for r in json.loads((out / "results.json").read_text())["load"]}
    for label, row in rows.items():
        records = sorted(row["records"], key=lambda rec: rec["index"])
        assert [rec["turn"] for rec in records] == [0, 1] and row["finished"] == 2, label
        assert records[1]["prompt_tokens"] > records[0]["prompt_tokens"] > 256  # the conversation, resent
    assert rows["none"]["hit_rate"] >= 256 / rows["none"]["records"][1]["prompt_tokens"]
    assert rows["off"]["hit_rate"] == 0.0 and rows["off"]["mismatches"] == 0
    assert "## Multi-turn conversations: the prefix cache" in (out / "results.md").read_text()


def test_multi_turn_levels_get_conversations_of_their_own(tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "multi-turn", "turns": ["a", "b"]}) + "\n"
                                 for i in range(5)))
    assert main(["bench-serve", "--questions", str(questions), "--multi-turn", "--concurrency", "1,4",
                 "--num-prompts", "3", "--output", str(tmp_path / "o")]) == 2
    assert "conversations of its own: 6 for levels 1,4 (3, 3), but --questions has 5" in capsys.readouterr().err
