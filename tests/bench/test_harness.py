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


def test_tiny_bench_writes_results(questions, tmp_path, tiny_target):
    model, tokenizer = tiny_target
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


@pytest.fixture(scope="module")
def tiny_target(smol_tokenizer):
    """The default model's tokenizer (installed offline) with a tiny random Llama of its vocabulary."""
    from specdraft.testing import tiny_llama

    return tiny_llama(vocab_size=len(smol_tokenizer), seed=4, max_positions=512), smol_tokenizer


def _interrupt_on(monkeypatch, question_id, method, exc=KeyboardInterrupt):
    """Make ``method``'s run on ``question_id`` raise ``exc``, as Ctrl-C there would; counts the calls."""
    from specdraft.bench.harness import _Methods

    real_run, calls = _Methods.run, []

    def run(self, name, ids, question):
        calls.append((name, question["question_id"]))
        if name == method and question["question_id"] == question_id:
            raise exc()
        return real_run(self, name, ids, question)

    monkeypatch.setattr(_Methods, "run", run)
    return calls


def test_interrupted_bench_keeps_the_finished_prompts(questions, tiny_target, monkeypatch):
    from specdraft.bench import BenchInterrupted

    model, tokenizer = tiny_target
    # Ctrl-C on the third prompt, after plain has run on it: that half-done prompt must be dropped.
    calls = _interrupt_on(monkeypatch, 3, "ngram")
    settings = BenchSettings(questions=str(questions), limit_per_category=None, drafters=["ngram"], max_new_tokens=4)
    with pytest.raises(BenchInterrupted) as caught:
        run_bench(model, tokenizer, settings, name="tiny", progress=False)
    stopped = caught.value
    assert isinstance(stopped, KeyboardInterrupt)  # callers that do not look for it still stop
    assert (stopped.finished, stopped.total) == (2, 3)
    assert ("plain", 3) in calls  # plain did finish the third prompt ...
    assert [(r.method, r.question_id) for r in stopped.records] == [
        ("plain", 1), ("ngram", 1), ("plain", 2), ("ngram", 2)]  # ... and is dropped with it
    assert stopped.summary["plain"]["overall"]["prompts"] == 2 and stopped.summary["ngram"]["overall"]["prompts"] == 2
    assert stopped.summary["ngram"]["overall"]["mismatches"] == 0
    assert stopped.env["questions"].endswith("(2 of 3 prompts: interrupted)")
    assert stopped.env["interrupted"].startswith("after 2 of 3 prompts")


def test_cli_bench_writes_the_finished_prompts_on_ctrl_c(questions, tiny_target, tmp_path, monkeypatch, capsys):
    """`specdraft bench` + Ctrl-C in the verifier (GenerationInterrupted) on the third prompt: results
    of the first two are written, one note on stderr, exit status 130."""
    from specdraft.cli import main
    from specdraft.engine import GenerationInterrupted

    model, tokenizer = tiny_target
    monkeypatch.setattr("specdraft.models.load_target", lambda *a, **k: (model, tokenizer, "tiny"))
    _interrupt_on(monkeypatch, 3, "prompt-lookup", lambda: GenerationInterrupted([]))
    out = tmp_path / "out"
    rc = main(["bench", "--questions", str(questions), "--drafters", "ngram,prompt-lookup",
               "--max-new-tokens", "4", "--output", str(out)])
    assert rc == 130
    data = json.loads((out / "results.json").read_text())
    assert sorted({r["question_id"] for r in data["records"]}) == [1, 2]
    assert len(data["records"]) == 2 * 3  # every method on each finished prompt, nothing of the third
    assert {m: data["summary"][m]["overall"]["prompts"] for m in data["summary"]} == {
        "plain": 2, "ngram": 2, "prompt-lookup": 2}
    assert "interrupted" in data["environment"]
    assert "- interrupted: after 2 of 3 prompts" in (out / "results.md").read_text()
    for png in ("speedup_by_category.png", "acceptance_by_position.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    err = capsys.readouterr().err.strip().splitlines()
    notes = [line for line in err if "interrupted" in line]
    assert notes == [f"specdraft: bench interrupted after 2 of 3 prompts; wrote their results.json, results.md "
                     f"and plots in {out}/"]


def test_cli_bench_ctrl_c_before_any_prompt_finished_writes_nothing(questions, tiny_target, tmp_path,
                                                                     monkeypatch, capsys):
    from specdraft.cli import main

    model, tokenizer = tiny_target
    monkeypatch.setattr("specdraft.models.load_target", lambda *a, **k: (model, tokenizer, "tiny"))
    _interrupt_on(monkeypatch, 0, "plain")  # question 0 is the warm-up
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("an earlier run")
    assert main(["bench", "--questions", str(questions), "--drafters", "ngram", "--output", str(out)]) == 130
    assert (out / "results.json").read_text() == "an earlier run"  # not replaced by an empty result
    assert "bench interrupted after 0 of 3 prompts; nothing written" in capsys.readouterr().err


# -- the llama-cpp peer --------------------------------------------------------------------------

def test_llama_cpp_peer_without_the_package_says_how_to_install(questions, monkeypatch, tmp_path, tiny_target):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    model, tokenizer = tiny_target
    settings = BenchSettings(questions=str(questions), drafters=[], peers=["llama-cpp"], gguf=str(tmp_path / "m.gguf"))
    with pytest.raises(ConfigError, match=r"the llama-cpp peer needs llama-cpp-python: pip install "
                                          r"'specdraft\[llama-cpp\]'"):
        run_bench(model, tokenizer, settings, progress=False)


def test_llama_cpp_peer_needs_a_gguf_target(questions, tiny_target):
    model, tokenizer = tiny_target
    settings = BenchSettings(questions=str(questions), drafters=[], peers=["llama-cpp"], gguf=None)
    with pytest.raises(ConfigError, match="the llama-cpp peer runs the target's GGUF file"):
        run_bench(model, tokenizer, settings, progress=False)


@pytest.mark.e2e
def test_llama_cpp_peer_runs_the_default_gguf_side_by_side(questions, tmp_path, request):
    """With llama-cpp-python installed (the optional extra): a row per prompt beside plain."""
    pytest.importorskip("llama_cpp", reason="needs pip install 'specdraft[llama-cpp]'")
    from specdraft.models import DEFAULT_TARGET, default_gguf_path

    (model, tokenizer), name = request.getfixturevalue("default_f32"), DEFAULT_TARGET  # after the skip: no load
    settings = BenchSettings(questions=str(questions), categories=["chat"], limit_per_category=1, drafters=[],
                             peers=["llama-cpp"], max_new_tokens=8, gguf=str(default_gguf_path()))
    records, summary, env = run_bench(model, tokenizer, settings, name=name, progress=False)
    peer = [r for r in records if r.method == "llama-cpp"]
    assert len(peer) == 1 and 0 < peer[0].new_tokens <= 8
    assert "llama-cpp" in summary and env["llama-cpp"].endswith("threads")


# -- predictions (issue 30: edits, with the original as the prediction) ---------------------------

@pytest.fixture
def predicted_questions(tmp_path):
    path = tmp_path / "p.jsonl"
    text = "red green blue red green blue"
    rows = [
        {"question_id": 1, "category": "edit-word", "turns": [f"Rewrite, but replace 'red' with 'pink':\n\n{text}"],
         "prediction": text},
        {"question_id": 2, "category": "chat", "turns": ["Say hello."], "prediction": None},
        {"question_id": 3, "category": "chat", "turns": ["Say goodbye."]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_load_questions_keeps_a_prediction(predicted_questions, tmp_path):
    rows = load_questions(predicted_questions)
    assert rows[0]["prediction"] == "red green blue red green blue"
    assert "prediction" not in rows[1] and "prediction" not in rows[2]  # null or absent: none
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["x"], "prediction": [1, 2]}) + "\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1: 'prediction' must be a string or null, not list"):
        load_questions(bad)


def test_bench_gives_the_prediction_to_the_drafters_only(predicted_questions, tiny_target, monkeypatch):
    """The prediction reaches generate_ids as the tokenized text (no template, no special tokens),
    for the drafters' decoders only: not plain decoding, not the peers, not questions without one."""
    from specdraft.decoder import SpeculativeDecoder

    model, tokenizer = tiny_target
    real, calls = SpeculativeDecoder.generate_ids, []

    def generate_ids(self, prompt_ids, *args, prediction=None, **kw):  # a decoder that records, then decodes
        calls.append((type(self.drafter).__name__, prediction))
        return real(self, prompt_ids, *args, **kw)

    monkeypatch.setattr(SpeculativeDecoder, "generate_ids", generate_ids)
    settings = BenchSettings(questions=str(predicted_questions), limit_per_category=None,
                             drafters=["ngram", "pl=prompt-lookup"], max_new_tokens=4, peers=["hf"])
    records, summary, env = run_bench(model, tokenizer, settings, name="tiny", progress=False)
    expected = [tokenizer("red green blue red green blue", add_special_tokens=False)["input_ids"]]
    plain, ngram, lookup = "NoDrafter", "NGramDrafter", "PromptLookupDrafter"
    assert calls == [
        (plain, None), (ngram, expected), (lookup, expected),  # warm-up, on the first question
        (plain, None), (ngram, expected), (lookup, expected),  # question 1
        (plain, None), (ngram, None), (lookup, None),  # question 2 (null)
        (plain, None), (ngram, None), (lookup, None)]  # question 3 (absent)
    assert {r.method for r in records} == {"plain", "ngram", "pl", "hf-generate", "hf-prompt-lookup"}
    assert env["predictions"].startswith("1 of 3 prompts carry a prediction")
    assert summary["ngram"]["overall"]["mismatches"] == 0 and "tokens_per_pass" in summary["ngram"]["overall"]


def test_bench_with_predictions_stays_exact(predicted_questions, tiny_target):
    """With the decoder's own prediction support: the drafters' outputs equal plain decoding's."""
    import inspect

    from specdraft.decoder import SpeculativeDecoder

    if "prediction" not in inspect.signature(SpeculativeDecoder.generate_ids).parameters:
        pytest.skip("SpeculativeDecoder.generate_ids takes no prediction yet")
    model, tokenizer = tiny_target
    settings = BenchSettings(questions=str(predicted_questions), limit_per_category=None, drafters=["ngram"],
                             max_new_tokens=16)
    records, summary, env = run_bench(model, tokenizer, settings, name="tiny", progress=False)
    assert summary["ngram"]["overall"]["mismatches"] == 0
    assert {r.question_id for r in records if r.method == "ngram"} == {1, 2, 3}


def test_repeats_run_whole_passes_with_fresh_decoders_and_keep_each_ones_median_run(questions, tiny_target,
                                                                                    monkeypatch):
    """--repeats 3: the bench runs three times over the prompts (plain and ngram interleaved on each),
    each pass with new decoders (the prompts' answers are in the last pass's prefix cache and in
    drafters' memories); each record kept is the method's run of median time (not the first, not
    the fastest)."""
    from specdraft.bench.harness import _Methods

    model, tokenizer = tiny_target
    real_run, calls, decoders = _Methods.run, [], []
    times = iter([5.0, 1.0, 6.0, 8.0, 3.0, 9.0, 7.0, 2.0, 2.0, 4.0, 4.0, 5.0])

    def run(self, name, ids, question):
        calls.append((name, question["question_id"]))
        decoders.append(self.decoders[name])  # held: no id is reused
        record = real_run(self, name, ids, question)
        if question["question_id"]:  # 0: the warm-up
            record.time_s = next(times)
        return record

    monkeypatch.setattr(_Methods, "run", run)
    settings = BenchSettings(questions=str(questions), categories=["chat"], limit_per_category=2, drafters=["ngram"],
                             max_new_tokens=4, repeats=3)
    records, summary, env = run_bench(model, tokenizer, settings, name="tiny", progress=False)
    one_pass = [("plain", 0), ("ngram", 0), ("plain", 2), ("ngram", 2), ("plain", 3), ("ngram", 3)]
    assert calls == one_pass * 3
    assert len({id(d) for d in decoders}) == 2 * 3  # each pass's own plain and ngram decoders
    # plain's times on prompt 2: 5, 3, 2 -> 3; ngram's 1, 9, 4 -> 4; on prompt 3: 6, 7, 4 -> 6 and 8, 2, 5 -> 5
    assert [(r.method, r.question_id, r.time_s) for r in records] == [
        ("plain", 2, 3.0), ("ngram", 2, 4.0), ("plain", 3, 6.0), ("ngram", 3, 5.0)]
    assert summary["ngram"]["overall"]["mismatches"] == 0 and summary["ngram"]["overall"]["prompts"] == 2
    assert env["repeats"].startswith("3 (whole passes, each with fresh decoders")


def test_repeats_that_differ_stop_the_bench_with_one_line():
    from specdraft.bench.harness import median_run
    from specdraft.bench.report import RunRecord
    from specdraft.errors import SpecdraftError

    runs = [RunRecord("ngram", 7, "chat", 2, t, ids, drafted=0) for t, ids in ((1.0, [1, 2]), (2.0, [1, 3]))]
    with pytest.raises(SpecdraftError, match="ngram gave different tokens on repeats of prompt 7"):
        median_run(runs)
    peers = [RunRecord("llama-cpp", 7, "chat", 2, t, ids) for t, ids in ((3.0, [1, 2]), (1.0, [1, 3]), (2.0, [1]))]
    assert median_run(peers).time_s == 2.0  # a peer's repeats are its own affair


def test_repeats_below_one_are_refused(questions, capsys):
    from specdraft.cli import main

    assert main(["bench", "--questions", str(questions), "--repeats", "0"]) == 2
    assert "--repeats must be >= 1 (got 0)" in capsys.readouterr().err
