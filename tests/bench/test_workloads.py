"""The edits and repeated-work bench workloads (issue 30): deterministic, valid Spec-Bench rows,
edits whose prediction is the passage and differs from the expected answer only in the edit, and
nothing taken from Spec-Bench."""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import pytest

from specdraft.bench import load_questions
from specdraft.bench.workloads import (CHAT_TURNS, EDIT_KINDS, REFINE_TURNS, REPEATED_KINDS, TOOL_SET, WORD_SWAPS,
                                       build_edits, build_long_mix, build_multi_turn, build_repeated, build_tool_calls,
                                       clean_gsm8k_answer, default_data_dir, main)

SHARED = default_data_dir()
needs_shared = pytest.mark.skipif(not (SHARED / "gsm8k" / "train.jsonl").is_file()
                                  or not (SHARED / "self_instruct").is_dir(), reason="needs ../shared/data")

_PASSAGE = ("Maria bought {n} apples at the store on Monday, and her friends bought 12 more the next day. "
            "Because the apples were cheap, she also picked up some cookies and water for the children at "
            "school. How many apples did they buy in total, and how much money did Maria spend on the "
            "different things she carried home from the store that afternoon?")


@pytest.fixture
def data(tmp_path):
    """A small stand-in for ../shared/data: GSM8K-shaped problems and Self-Instruct tasks."""
    root = tmp_path / "data"
    (root / "gsm8k").mkdir(parents=True)
    (root / "self_instruct").mkdir()
    problems = [{"question": _PASSAGE.format(n=20 + i),
                 "answer": f"They bought {20 + i}+12 = <<{20 + i}+12={32 + i}>>{32 + i} apples.\n#### {32 + i}"}
                for i in range(30)]
    (root / "gsm8k" / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    for name, key in (("seed_tasks.jsonl", "name"), ("user_oriented_instructions.jsonl", "motivation_app")):
        tasks = [{"id": f"{name[:4]}_{i}", key: f"task {i}", "instruction": f"Write a short note about topic {i}.",
                  "instances": [{"input": "" if i % 2 else f"Topic {i}: gardens",
                                 "output": _PASSAGE.format(n=40 + i).replace("Maria", "Ana")}],
                  "is_classification": False} for i in range(25)]
        (root / "self_instruct" / name).write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return root


def _changed_words(prediction: str, reference: str) -> list[tuple[list[str], list[str]]]:
    """The word runs that differ between the two texts (``difflib`` over whitespace-split words)."""
    a, b = prediction.split(), reference.split()
    ops = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
    return [(a[i1:i2], b[j1:j2]) for tag, i1, i2, j1, j2 in ops if tag != "equal"]


def _pieces(word: str) -> list[str]:
    return re.findall(r"\d+|[^\W\d_]+|\S", word)


def check_edit(row: dict) -> None:
    """The prompt is the instruction followed by the prediction; the expected answer (``reference``)
    differs from the prediction only where the instruction says."""
    prompt, prediction, reference = row["turns"][0], row["prediction"], row["reference"]
    assert prompt.endswith("\n\n" + prediction) and prediction != reference
    instruction = prompt[: -len(prediction)]
    changes = _changed_words(prediction, reference)
    assert 1 <= len(changes) <= 3, changes
    if row["category"] == "edit-number":
        old, new = re.search(r"change the number (\d+) to (\d+)", instruction).groups()
        pairs = [(old, new)]
    elif row["category"] == "edit-word":
        old, new = re.search(r"replace the word '(\w+)' with '(\w+)'", instruction).groups()
        assert WORD_SWAPS[old] == new
        pairs = [(old, new)]
    else:
        typo = re.search(r"fix the misspelled word '(\w+)'", instruction).group(1)
        pairs = [(typo, None)]
        assert len(changes) == 1 and sorted(changes[0][0][0]) == sorted(changes[0][1][0])  # two letters swapped
    old, new = pairs[0]
    swapped = 0
    for before, after in changes:
        assert len(before) == len(after) == 1, (before, after)  # one word for one word
        if new is None:
            assert old in _pieces(before[0]), (before, old)
            continue
        a, b = _pieces(before[0]), _pieces(after[0])  # numbers, letters and single marks
        assert len(a) == len(b) and {(x, y) for x, y in zip(a, b) if x != y} == {(old, new)}, (before, after)
        swapped += sum(x != y for x, y in zip(a, b))
    if row["category"] == "edit-number":  # "everywhere it appears": no '4p' or '4.5' left unchanged
        assert swapped == len(re.findall(rf"(?<!\d){old}(?!\d)", prediction))
    assert difflib.SequenceMatcher(a=prediction, b=reference, autojunk=False).ratio() > 0.9


def test_builders_are_deterministic_and_seeded(data):
    assert build_edits(data, 12, seed=3) == build_edits(data, 12, seed=3)
    assert build_repeated(data, 12, seed=3) == build_repeated(data, 12, seed=3)
    assert build_edits(data, 12, seed=3) != build_edits(data, 12, seed=4)
    assert build_repeated(data, 12, seed=3) != build_repeated(data, 12, seed=4)


def test_edits_rows(data):
    rows = build_edits(data, 12)
    assert [r["category"] for r in rows] == list(EDIT_KINDS) * 4
    assert len({r["question_id"] for r in rows}) == 12
    sources = {r["source"].split("/")[0] for r in rows}
    assert sources == {"gsm8k", "self_instruct"}
    for row in rows:
        assert set(row) == {"question_id", "category", "turns", "prediction", "reference", "source"}
        check_edit(row)


def test_repeated_rows(data):
    rows = build_repeated(data, 14)
    counts = {kind: sum(r["category"] == kind for r in rows) for kind in REPEATED_KINDS}
    assert counts == {"repeated-gsm8k": 5, "repeated-json": 5, "repeated-refine": 4}
    assert all(r["prediction"] is None for r in rows) and len({r["question_id"] for r in rows}) == 14
    categories = [r["category"] for r in rows]
    assert categories == sorted(categories, key=REPEATED_KINDS.index)  # each stream's requests in a row
    gsm = [r["turns"][0] for r in rows if r["category"] == "repeated-gsm8k"]
    head = gsm[0].split("Problem:")[0]
    assert all(p.startswith(head) for p in gsm) and len(set(gsm)) == len(gsm)  # one task, different inputs
    refine = [r["turns"][0] for r in rows if r["category"] == "repeated-refine"]
    # a task asked again with a constraint more each time
    assert refine[1].startswith(refine[0]) and refine[2].startswith(refine[1]) and refine[0] != refine[1]
    assert not refine[REFINE_TURNS].startswith(refine[0])  # the next task


def test_long_mix_rows(data):
    rows = build_long_mix(data, 8)
    assert [r["category"] for r in rows] == ["short-chat"] * 3 + ["long-document"] + ["short-chat"] * 3 + \
        ["long-document"]
    long = [r["turns"][0] for r in rows if r["category"] == "long-document"]
    short = [r["turns"][0] for r in rows if r["category"] == "short-chat"]
    assert len(set(long)) == 2 and len(set(short)) == 6 and len({r["question_id"] for r in rows}) == 8
    # a long prompt is the small fixture's whole GSM8K file, worked, then one question about it
    assert all(p.count("Problem ") >= 2 and p.endswith("what is its answer?") for p in long)
    assert max(len(p) for p in short) < min(len(p) for p in long)


def test_multi_turn_rows(data, tmp_path):
    rows = build_multi_turn(data, 4)
    assert build_multi_turn(data, 4) == rows and build_multi_turn(data, 4, seed=1) != rows
    assert len({r["system"] for r in rows}) == 1 and rows[0]["system"].count("Example ") >= 2
    assert all(len(r["turns"]) == CHAT_TURNS and r["category"] == "multi-turn" for r in rows)
    assert len({t for r in rows for t in r["turns"]}) == 4 * CHAT_TURNS  # every request once
    with pytest.raises(ValueError, match="need 40 short Self-Instruct requests"):
        build_multi_turn(data, 10)
    assert main(["--out", str(tmp_path), "--data", str(data), "--edits", "0", "--repeated", "0", "--long-mix", "0",
                 "--multi-turn", "2"]) == 0
    read = load_questions(tmp_path / "multi_turn.jsonl")
    assert [(q["system"], q["turns"]) for q in read] == [(r["system"], r["turns"]) for r in rows[:2]]


def test_tool_call_rows(data, tmp_path):
    rows = build_tool_calls(data, 6)
    assert build_tool_calls(data, 6) == rows and build_tool_calls(data, 6, seed=1) != rows
    assert all(r["category"] == "tool-call" and r["tools"] == TOOL_SET for r in rows)
    assert [r["tool_choice"] for r in rows[:2]] == [{"type": "function", "function": {"name": "save_note"}}, "required"]
    assert len({r["turns"][0].split("\n\n", 1)[1] for r in rows}) == 6  # every request once
    with pytest.raises(ValueError, match="need 1000 short Self-Instruct requests"):
        build_tool_calls(data, 1000)
    assert main(["--out", str(tmp_path), "--data", str(data), "--edits", "0", "--repeated", "0", "--long-mix", "0",
                 "--multi-turn", "0", "--tool-calls", "3"]) == 0
    read = load_questions(tmp_path / "tool_calls.jsonl")
    assert [(q["prompt"], q["tools"], q["tool_choice"]) for q in read] == [
        (r["turns"][0], r["tools"], r["tool_choice"]) for r in rows[:3]]


def test_cli_writes_files_the_bench_reads(data, tmp_path, capsys):
    out = tmp_path / "wl"
    assert main(["--out", str(out), "--data", str(data), "--edits", "9", "--repeated", "6", "--long-mix", "0",
                 "--multi-turn", "0"]) == 0
    assert "edits.jsonl (9 rows)" in capsys.readouterr().out
    edits = load_questions(out / "edits.jsonl")
    assert len(edits) == 9 and all(q["prediction"] and q["prompt"].endswith(q["prediction"]) for q in edits)
    repeated = load_questions(out / "repeated.jsonl", limit_per_category=None)
    assert len(repeated) == 6 and all("prediction" not in q for q in repeated)
    assert [json.loads(line) for line in (out / "edits.jsonl").read_text().splitlines()] == build_edits(data, 9)
    assert main(["--out", str(tmp_path / "none"), "--data", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_gsm8k_answers_read_as_prose():
    assert clean_gsm8k_answer("She sold 48/2 = <<48/2=24>>24 clips.\n#### 24") == \
        "She sold 48/2 = 24 clips.\nThe answer is 24."


@needs_shared
def test_shared_data_workloads(tmp_path):
    """The real data: the default sizes build, every edit is small, and no prompt comes from Spec-Bench."""
    edits, repeated = build_edits(SHARED, 60), build_repeated(SHARED, 60)
    assert len(edits) == len(repeated) == 60
    for row in edits:
        check_edit(row)
    assert all(not r["source"].startswith("spec_bench") for r in edits + repeated)
    spec = SHARED / "spec_bench" / "question.jsonl"
    if spec.is_file():  # no passage or request of ours appears in a Spec-Bench question
        text = " ".join(" ".join(json.loads(line)["turns"]) for line in spec.read_text().splitlines() if line.strip())
        text = re.sub(r"\s+", " ", text)
        for row in edits + repeated:
            body = re.sub(r"\s+", " ", row["prediction"] or row["turns"][0].split("\n\n", 1)[-1])
            chunk = body[:80]
            assert chunk not in text, (row["question_id"], chunk)
