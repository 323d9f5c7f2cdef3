"""A tiny end-to-end bench: structure of the outputs (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from specdraft.bench import BenchSettings, load_questions, run_bench, write_outputs
from specdraft.errors import ConfigError


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "copy", "turns": ["Repeat: red green blue red green blue", "ignored"]},
        {"question_id": 2, "category": "chat", "turns": ["Say hello."]},
        {"question_id": 3, "category": "chat", "turns": ["Say goodbye."]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_load_questions_filters_and_limits(questions):
    assert [q["question_id"] for q in load_questions(questions, ["chat"], 1)] == [2]
    assert load_questions(questions)[0]["prompt"].startswith("Repeat:")
    with pytest.raises(ConfigError, match="no questions in categories \\['nope'\\]"):
        load_questions(questions, ["nope"])


def test_bad_question_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: not a Spec-Bench question"):
        load_questions(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_questions(tmp_path / "missing.jsonl")


def test_tiny_bench_writes_results(questions, tmp_path):
    from transformers import AutoTokenizer

    from specdraft.models import resolve_target
    from specdraft.testing import tiny_llama

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(None)[1])
    model = tiny_llama(vocab_size=len(tokenizer), seed=4, max_positions=512)
    settings = BenchSettings(questions=str(questions), categories=["copy", "chat"], limit_per_category=1,
                             drafters=["ngram", "prompt-lookup", "ngram-2=ngram"], max_new_tokens=8, peers=["hf"],
                             drafter_options={"ngram": {"max_order": 3}, "ngram-2": {"max_order": 2}})
    records, summary, env = run_bench(model, tokenizer, settings, name="tiny", progress=False)
    out = write_outputs(tmp_path / "out", records, summary, env)

    data = json.loads((out / "results.json").read_text())
    methods = {"plain", "ngram", "prompt-lookup", "ngram-2", "hf-generate", "hf-prompt-lookup"}
    assert set(data["summary"]) == methods
    for method in methods:
        entry = data["summary"][method]
        assert set(entry) == {"copy", "chat", "overall"}
        for key in ("speedup", "tokens_per_second", "mismatches"):
            assert key in entry["overall"]
    for method in ("ngram", "prompt-lookup", "ngram-2"):
        for key in ("acceptance_rate", "tokens_per_pass", "acceptance_by_position", "theoretical_speedup", "time_split"):
            assert key in data["summary"][method]["overall"]
        assert data["summary"][method]["overall"]["mismatches"] == 0  # exactness, on every prompt
    assert {"model", "device", "versions", "spec_length", "torch_threads"} <= set(data["environment"])
    assert data["environment"]["ngram options"] == "max_order=3"  # what was benchmarked is on record
    assert data["environment"]["ngram-2 options"] == "max_order=2"  # one drafter twice, under its own label
    assert len(data["records"]) == 2 * len(methods)
    md = (out / "results.md").read_text()
    assert "## Overall" in md and "| ngram |" in md and "hf-prompt-lookup" in md
    for png in ("speedup_by_category.png", "acceptance_by_position.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_drafter_labels(questions):
    from specdraft.bench.harness import split_method
    from specdraft.cli import main

    assert split_method("eagle") == ("eagle", "eagle") and split_method("e0 = eagle") == ("e0", "eagle")
    with pytest.raises(ConfigError, match="expected DRAFTER or LABEL=DRAFTER"):
        split_method("=eagle")
    # options name labels; an option for a label that does not run is refused before any model loads
    assert main(["bench", "--questions", str(questions), "--drafters", "e0=ngram",
                 "--drafter-option", "ngram:max_order=3"]) == 2
