"""The CLI as a user runs it: readable output, and one line on bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "specdraft.cli", *args], capture_output=True, text=True, input=stdin,
                          timeout=300)


def test_generate_with_stats_prints_text_and_acceptance_rate():
    out = run("generate", "--drafter", "ngram", "--stats", "--max-new-tokens", "48",
              "List the days of the week, then list them again.")
    assert out.returncode == 0, out.stderr
    assert "Monday" in out.stdout
    assert "acceptance rate:" in out.stderr and "tokens per pass:" in out.stderr


@pytest.mark.parametrize("drafter", ["draft-model", "medusa", "eagle", "mlp-speculator"])
def test_learnt_drafters_work_offline_with_stats(drafter):
    out = run("generate", "--drafter", drafter, "--stats", "--max-new-tokens", "32",
              "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "acceptance rate:" in out.stderr


def test_generate_reads_stdin_and_honours_raw():
    out = run("generate", "--raw", "--max-new-tokens", "5", "--drafter", "prompt-lookup", "-", stdin="One, two, three,")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


@pytest.mark.parametrize("args, message", [
    (["generate", ""], "the prompt is empty"),
    (["generate", "--spec-length", "0", "hi"], "spec_length must be an integer >= 1"),
    (["generate", "--temperature", "-1", "hi"], "temperature: Input should be greater than or equal to 0"),
    (["generate", "--top-p", "0", "hi"], "top_p: Input should be greater than 0"),
    (["generate", "--top-p", "2", "hi"], "top_p: Input should be less than or equal to 1"),
    (["generate", "--top-k", "-5", "hi"], "top_k: Input should be greater than or equal to 0"),
    (["generate", "--max-new-tokens", "0", "hi"], "max_new_tokens must be an integer >= 1"),
    (["generate", "--drafter", "nope", "hi"], "unknown drafter 'nope'; known drafters: "),
    (["generate", "--drafter-option", "max_order=x", "hi"], "invalid options for drafter 'ngram': max_order"),
    (["generate", "--target", "./no/such/dir", "hi"], "no such model directory"),
    (["generate", "--drafter", "eagle", "--drafter-option", "heads=./no/such/dir", "hi"],
     "heads folder './no/such/dir' does not exist; pass --drafter-option heads=DIR"),
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
def test_bad_input_is_one_readable_line(args, message):
    out = run(*args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("specdraft: error: ") and message in lines[0], out.stderr


def test_prompt_longer_than_the_context_is_one_line():
    out = run("generate", "--raw", "-", stdin="word " * 9000)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "shorten it to at most 8191 tokens" in out.stderr


def test_argparse_usage_errors_exit_2():
    out = run("generate", "--top-k", "many", "hi")
    assert out.returncode == 2 and "invalid int value" in out.stderr and "Traceback" not in out.stderr
