"""Bad input through the CLI, in process: one line and exit 2, before any model loads.

(``tests/e2e/test_cli.py`` runs one such error in a fresh process, and the errors that need the
real model or broken model files.)
"""

from __future__ import annotations

import io

import pytest

from specdraft.cli import main


@pytest.fixture(autouse=True)
def no_model(monkeypatch, tmp_path):
    """Loading a model fails the test: every error here comes first (a path that is no model fails
    in resolve_target, as in the real loader). Relative paths start in tmp_path."""
    from specdraft.models import resolve_target

    def load_target(target=None, *args, **kwargs):
        resolve_target(target)
        pytest.fail("the model was loaded before the bad input was reported")

    monkeypatch.setattr("specdraft.models.load_target", load_target)
    monkeypatch.chdir(tmp_path)


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("specdraft: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["generate", ""], "the prompt is empty"),
    (["generate", "--seed", str(2**64), "hi"],
     "seed must be an integer from 0 to 2**64 - 1, or None (got 18446744073709551616)"),
    (["generate", "--temperature", "-1", "hi"], "temperature: Input should be greater than or equal to 0"),
    (["generate", "--temperature", "1e-38", "hi"],
     "temperature: Value error, must be 0 (greedy) or from 0.0001 to 100"),
    (["generate", "--temperature", "inf", "hi"], "temperature: Input should be a finite number"),
    (["generate", "--spec-length", "0", "hi"], "spec_length must be an integer from 1 to 16 (got 0)"),
    (["generate", "--spec-length", "1000", "hi"], "spec_length must be an integer from 1 to 16 (got 1000)"),
    (["generate", "--top-p", "0", "hi"], "top_p: Input should be greater than 0"),
    (["generate", "--top-p", "2", "hi"], "top_p: Input should be less than or equal to 1"),
    (["generate", "--top-k", "-5", "hi"], "top_k: Input should be greater than or equal to 0"),
    (["generate", "--min-p", "2", "hi"], "min_p: Input should be less than or equal to 1"),
    (["generate", "--repetition-penalty", "0", "hi"], "repetition_penalty: Input should be greater than 0"),
    (["generate", "--presence-penalty", "9", "hi"], "presence_penalty: Input should be less than or equal to 2"),
    (["generate", "--frequency-penalty", "-9", "hi"],
     "frequency_penalty: Input should be greater than or equal to -2"),
    (["generate", "--max-new-tokens", "0", "hi"], "max_new_tokens must be an integer >= 1"),
    (["generate", "--drafter", "nope", "hi"], "unknown drafter 'nope'; known drafters: "),
    (["generate", "--drafter-option", "max_order=x", "hi"], "invalid options for drafter 'ngram': max_order"),
    (["generate", "--target", "./no/such/dir", "hi"], "no such model directory: './no/such/dir'"),
    (["generate", "--prediction", "./no/such/file.py", "hi"], "--prediction ./no/such/file.py: cannot read it"),
    (["bench", "--questions", "q.jsonl", "--drafters", "ngram", "--drafter-option", "draft-model:model=x"],
     "--drafter-option names draft-model, which --drafters does not run"),
    (["bench", "--questions", "q.jsonl", "--drafters", "ngram", "--drafter-option", "ngram:nope=1"],
     "invalid options for drafter 'ngram': nope"),
    (["train-heads", "--kind", "medusa", "--output", "x", "--prompts", "./missing.jsonl"],
     "prompt file './missing.jsonl' does not exist"),
    (["train-heads", "--kind", "eagle", "--output", "x", "--prompts", "./missing.jsonl", "--steps", "0"],
     "--steps must be >= 1"),
    (["distill", "--output", "x", "--prompts", "./missing.jsonl", "--generate-batch-size", "0"],
     "--generate-batch-size must be >= 1"),
])
def test_bad_input_is_one_line(capsys, args, message):
    assert main(args) == 2
    assert message in _one_line(capsys)


def test_argparse_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--top-k", "many", "hi"])
    assert info.value.code == 2
    assert capsys.readouterr().err.endswith("specdraft generate: error: argument --top-k: invalid int value: 'many'\n")


def test_a_prompt_argument_that_is_not_utf8_is_one_line(capsys):
    # what Python makes of argv bytes that are not UTF-8 (b"caf\xe9 au lait": Latin-1)
    assert main(["generate", "caf\udce9 au lait"]) == 2
    assert "the prompt is not valid UTF-8 (byte 0xe9 at offset 3)" in _one_line(capsys)


def test_stdin_that_is_not_utf8_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait")))
    assert main(["generate", "-"]) == 2
    assert "the prompt is not valid UTF-8 (byte 0xe9 at offset 3)" in _one_line(capsys)
