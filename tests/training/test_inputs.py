"""Training inputs: each bad one is one line (CLI exit 2, the same ConfigError from Python), and
the data caches are keyed by what built them: reused when it is the same, rebuilt when not."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specdraft import ConfigError
from specdraft.cli import main
from specdraft.training import data, load_prompts, train


def _no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the input was checked")


def _no_generation(*args, **kwargs):
    raise AssertionError("data was generated before the input was checked")


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("specdraft: error:")]


BAD_LINES = [
    (b'"just a string"', 'expected a JSON object such as {"prompt": "..."}, not a string'),
    (b"[1, 2]", 'expected a JSON object such as {"prompt": "..."}, not a list'),
    (b'{"prompt": 123}', "'prompt' must be a string, not a number (123)"),
    (b'{"question": "Why?", "answer": ["a"]}', "'answer' must be a string, not a list ([\"a\"])"),
    (b'{"prompt": "caf\xe9"}', "not UTF-8 text (byte 0xe9 at column 16); save the file as UTF-8"),
]


@pytest.mark.parametrize("command", ["distill", "train-heads"])
@pytest.mark.parametrize("line, message", BAD_LINES)
def test_a_bad_prompt_line_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, command, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "A fine one."}\n' + line + b"\n")
    monkeypatch.setattr("specdraft.models.load_target", _no_model)
    kind = ["--kind", "medusa"] if command == "train-heads" else []
    assert main([command, *kind, "--output", str(tmp_path / "out"), "--prompts", str(path)]) == 2
    assert _error_lines(capsys.readouterr().err) == [f"specdraft: error: {path}:2: {message}"]
    with pytest.raises(ConfigError) as err:
        load_prompts([path])
    assert str(err.value) == f"{path}:2: {message}"


@pytest.mark.parametrize("lr", ["-1", "0", "nan", "inf"])
def test_lr_must_be_a_finite_number_above_zero(tmp_path, qa_file, capsys, monkeypatch, lr):
    monkeypatch.setattr("specdraft.models.load_target", _no_model)
    for command in (["distill"], ["train-heads", "--kind", "eagle"]):
        assert main([*command, "--output", str(tmp_path), "--prompts", str(qa_file), "--lr", lr]) == 2
        assert _error_lines(capsys.readouterr().err) == [
            f"specdraft: error: lr must be a finite number > 0, not {float(lr)!r}"]
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match=rf"^lr must be a finite number > 0, not {float(lr)!r}$"):
        train({"w": w}, lambda step: w.sum(), 1, tmp_path, lr=float(lr), progress=False)


def test_lr_and_layers_fail_in_python_before_any_data_generation(tmp_path, qa_file, tiny_target, smol_tokenizer,
                                                                 monkeypatch):
    from specdraft.training.distill import distill
    from specdraft.training.heads import train_heads

    monkeypatch.setattr(data, "generate_sequences", _no_generation)
    with pytest.raises(ConfigError, match=r"^layers must be 1 to 2 \(the target's layer count\), not 99$"):
        distill(tiny_target, smol_tokenizer, "tiny", [qa_file], tmp_path / "d", layers=99)
    with pytest.raises(ConfigError, match=r"^lr must be a finite number > 0, not -1$"):
        distill(tiny_target, smol_tokenizer, "tiny", [qa_file], tmp_path / "d", layers=1, lr=-1)
    with pytest.raises(ConfigError, match=r"^lr must be a finite number > 0, not -1$"):
        train_heads(tiny_target, smol_tokenizer, "tiny", "medusa", [qa_file], tmp_path / "h", lr=-1)


def test_distill_layers_beyond_the_target_is_one_line_before_any_data_generation(tmp_path, qa_file, tiny_target_dir,
                                                                                 capsys, monkeypatch):
    monkeypatch.setattr(data, "generate_sequences", _no_generation)
    assert main(["distill", "--target", str(tiny_target_dir), "--output", str(tmp_path / "out"),
                 "--prompts", str(qa_file), "--layers", "99"]) == 2
    assert _error_lines(capsys.readouterr().err) == [
        "specdraft: error: layers must be 1 to 2 (the target's layer count), not 99"]
    assert not (tmp_path / "out" / "work" / "sequences.json").exists()


def test_answers_are_reused_for_the_same_inputs_and_rebuilt_when_they_change(tmp_path, qa_file, tiny_target,
                                                                            smol_tokenizer, capsys, monkeypatch):
    from specdraft.training.data import target_generations

    cache = tmp_path / "work" / "sequences.json"
    generated = []
    real = data.generate_sequences
    monkeypatch.setattr(data, "generate_sequences", lambda *a, **k: generated.append(1) or real(*a, **k))

    def answers(max_new_tokens=2):
        generated.clear()
        out = target_generations(tiny_target, smol_tokenizer, [qa_file], cache, 4, max_new_tokens=max_new_tokens,
                                 batch_size=4)
        return out, capsys.readouterr().err

    first, _ = answers()
    again, err = answers()
    assert again == first and not generated and "reusing cached answers (key " in err

    qa_file.write_text(json.dumps({"prompt": "Name three colours."}) + "\n")  # same name, other content
    changed, err = answers()
    assert generated and f"inputs changed (prompt_files): rebuilding answers in {cache}" in err
    assert changed != first and len(changed) == 1

    longer, err = answers(max_new_tokens=3)
    assert generated and "inputs changed (max_new_tokens 2 -> 3): rebuilding answers" in err
    assert [len(s["ids"]) - s["prompt_len"] for s in longer] == [3]

    cache.write_text(cache.read_text()[:40])  # truncated, as by a crash with an older specdraft
    rebuilt, err = answers(max_new_tokens=3)
    assert rebuilt == longer and f"{cache} is damaged or from an older specdraft (JSONDecodeError): rebuilding" in err


def test_target_states_are_keyed_by_the_sequences_they_were_computed_from(tmp_path, tiny_target, capsys):
    from specdraft.training.data import target_features

    cache = tmp_path / "states.safetensors"
    seqs = [{"ids": [5, 6, 7, 8], "prompt_len": 2}, {"ids": [9, 10, 11], "prompt_len": 1}]
    first = target_features(tiny_target, seqs, cache)
    assert all(torch.equal(a, b) for a, b in zip(target_features(tiny_target, seqs, cache), first))
    assert "reusing cached target states" in capsys.readouterr().err
    other = [{"ids": [5, 6, 7, 9], "prompt_len": 2}, seqs[1]]  # same lengths, another token
    changed = target_features(tiny_target, other, cache)
    assert "inputs changed (sequences): rebuilding target states" in capsys.readouterr().err
    assert not torch.equal(changed[0], first[0])
    cache.write_bytes(cache.read_bytes()[:50])
    assert all(torch.equal(a, b) for a, b in zip(target_features(tiny_target, other, cache), changed))
    assert f"{cache} is damaged" in capsys.readouterr().err


def test_target_states_of_chosen_layers_equal_transformers_hidden_states(tmp_path, tiny_model, capsys):
    """layers=: transformers' output_hidden_states[i] side by side, in the order asked (float64,
    computed in padded batches as for training; n_layers is the final-norm state), cached in a
    file and under a key of their own; float16 by default, clamped to its range, not inf."""
    from specdraft.training.data import states_file, target_features

    seqs = [{"ids": [5, 6, 7, 8, 9, 10, 11], "prompt_len": 2}, {"ids": [9, 10, 11], "prompt_len": 1},
            {"ids": [3, 4, 5, 6], "prompt_len": 1}, {"ids": [7, 8, 9, 10, 1], "prompt_len": 3}]
    layers = (1, 0, 2)
    got = target_features(tiny_model, seqs, layers=layers, dtype=torch.float64, batch_tokens=12, progress=False)
    with torch.no_grad():
        for s, states in zip(seqs, got):
            ref = tiny_model.model(input_ids=torch.tensor([s["ids"]]), output_hidden_states=True).hidden_states
            assert states.dtype == torch.float64 and states.shape == (len(s["ids"]), 3 * 32)
            torch.testing.assert_close(states, torch.cat([ref[i][0] for i in layers], -1), rtol=1e-12, atol=1e-12)
    half = target_features(tiny_model, seqs, layers=layers, batch_tokens=12, progress=False)
    assert all(torch.equal(h, g.to(torch.float16)) for h, g in zip(half, got))

    cache = states_file(tmp_path, "answer_states", layers)
    assert cache.name == "answer_states_layers_1_0_2.safetensors" and states_file(tmp_path, "answer_states").name \
        == "answer_states.safetensors"
    first = target_features(tiny_model, seqs, cache, layers=layers, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(target_features(tiny_model, seqs, cache, layers=layers), first))
    assert "reusing cached target states" in capsys.readouterr().err
    target_features(tiny_model, seqs, cache, layers=(0, 1, 2))
    assert "inputs changed (layers): rebuilding target states" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"target layers \[3\] are not all among 0..2"):
        target_features(tiny_model, seqs, layers=(3,))

    loud = copy.deepcopy(tiny_model)
    with torch.no_grad():
        loud.model.embed_tokens.weight.mul_(1e7)  # layer 0's states (the embeddings) beyond float16's range
    states = target_features(loud, seqs[:1], layers=(0,), progress=False)[0]
    assert bool(torch.isfinite(states).all()) and float(states.abs().max()) == torch.finfo(torch.float16).max


def test_rerunning_into_the_same_folders_with_other_prompts_retrains_on_them(tmp_path, qa_file, tiny_target_dir,
                                                                            capsys):
    """The reported bug: the second run reused the first one's answers and checkpoint, and its
    metadata named prompt files the heads never saw."""
    from specdraft.drafters.heads.formats import FORMAT_FILE

    colours = tmp_path / "colours.jsonl"
    colours.write_text("\n".join(json.dumps({"prompt": f"Name {i} colours.", "answer": "Red and blue."})
                                 for i in range(3)) + "\n")
    out = tmp_path / "heads"

    def run(prompts, max_new_tokens: str) -> str:
        code = main(["train-heads", "--kind", "medusa", "--target", str(tiny_target_dir), "--output", str(out),
                     "--prompts", str(prompts), "--num-prompts", "3", "--num-texts", "3", "--max-new-tokens",
                     max_new_tokens, "--steps", "2", "--batch-size", "2", "--head-tokens", "64", "--gate-steps", "0"])
        err = capsys.readouterr().err
        assert code == 0, err
        return err

    run(qa_file, "2")
    err = run(colours, "3")
    assert "inputs changed (max_new_tokens 2 -> 3, prompt_files): rebuilding answers" in err
    assert "training settings changed (answers, head_tokens, texts): not resuming" in err
    assert json.loads((out / FORMAT_FILE).read_text())["prompt_files"] == ["colours.jsonl"]
    answers = json.loads((out / "work" / "sequences.json").read_text())["data"]
    assert [len(s["ids"]) - s["prompt_len"] for s in answers] == [3, 3, 3]
    assert "reusing cached answers" in run(colours, "3")
