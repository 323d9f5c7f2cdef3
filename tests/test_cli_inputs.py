"""Bad generate input through the CLI, in process: one line and exit 2, before any model loads."""

from __future__ import annotations

import io

import pytest

from specdraft.cli import main


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specdraft: error: "), err
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["--seed", str(2**64)], "seed must be an integer from 0 to 2**64 - 1, or None (got 18446744073709551616)"),
    (["--temperature", "1e-38"], "temperature: Value error, must be 0 (greedy) or from 0.0001 to 100"),
    (["--temperature", "inf"], "temperature: Input should be a finite number"),
    (["--spec-length", "1000"], "spec_length must be an integer from 1 to 16 (got 1000)"),
    (["--min-p", "2"], "min_p: Input should be less than or equal to 1"),
    (["--repetition-penalty", "0"], "repetition_penalty: Input should be greater than 0"),
    (["--presence-penalty", "9"], "presence_penalty: Input should be less than or equal to 2"),
    (["--frequency-penalty", "-9"], "frequency_penalty: Input should be greater than or equal to -2"),
])
def test_bad_settings_are_one_line(capsys, args, message):
    assert main(["generate", *args, "hi"]) == 2
    assert message in _one_line(capsys)


def test_a_prompt_argument_that_is_not_utf8_is_one_line(capsys):
    # what Python makes of argv bytes that are not UTF-8 (b"caf\xe9 au lait": Latin-1)
    assert main(["generate", "caf\udce9 au lait"]) == 2
    assert "the prompt is not valid UTF-8 (byte 0xe9 at offset 3)" in _one_line(capsys)


def test_stdin_that_is_not_utf8_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait")))
    assert main(["generate", "-"]) == 2
    assert "the prompt is not valid UTF-8 (byte 0xe9 at offset 3)" in _one_line(capsys)
