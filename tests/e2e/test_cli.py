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
    (["generate", "--spec-length", "0", "hi"], "spec_length must be an integer from 1 to 16"),
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


def _one_line_error(out) -> str:
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specdraft: error: "), out.stderr
    return lines[0]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case, message", [
    ("truncated-gguf", "GGUF file '{d}/half.gguf' is truncated or corrupt ("),
    ("draft-empty-folder", "draft model: '{d}/empty' is not a model folder: it is empty"),
    ("bad-config", "'{d}/bad/config.json' is not valid JSON (Expecting property name enclosed in double quotes: "
                   "line 1 column 9 (char 8))"),
    ("no-tokenizer", "model folder '{d}/notok' has no tokenizer files: add the tokenizer of the model it comes from "
                     "(tokenizer.json and tokenizer_config.json"),
    ("hub-offline", "model 'someorg/some-model' is not (fully) in the Hugging Face cache and the hub "
                    "(http://127.0.0.1:{port}) cannot be reached. Point --target at a local copy"),
    ("plugin-import", "unknown drafter 'bad-import': plugin 'specdraft-bad-import', which would provide it, failed to "
                      "import 'specdraft_bad_import_mod': ModuleNotFoundError: No module named 'not_installed_pkg'"),
])
def test_broken_models_and_plugins_say_what_is_wrong(tmp_path, case, message):
    """Local paths that exist but are broken, a hub id without network (no HF_HUB_OFFLINE: one probe,
    no retries), a plugin that failed to import: one line each, saying what is wrong."""
    import os

    env = dict(os.environ)
    args = ["generate", "--max-new-tokens", "2", "hi"]
    port = _closed_port()
    if case == "truncated-gguf":
        from specdraft.models import default_gguf_path

        with open(default_gguf_path(), "rb") as f:  # a download cut short
            (tmp_path / "half.gguf").write_bytes(f.read(2_000_000))
        args += ["--target", str(tmp_path / "half.gguf")]
    elif case == "draft-empty-folder":
        (tmp_path / "empty").mkdir()
        args += ["--drafter", "draft-model", "--drafter-option", f"model={tmp_path / 'empty'}"]
    elif case == "bad-config":
        (tmp_path / "bad").mkdir()
        (tmp_path / "bad" / "config.json").write_text('{"a": 1,, }')
        args += ["--target", str(tmp_path / "bad")]
    elif case == "no-tokenizer":
        from specdraft.testing import tiny_llama

        tiny_llama(vocab_size=64, seed=0, layers=1).save_pretrained(tmp_path / "notok")
        args += ["--target", str(tmp_path / "notok")]
    elif case == "hub-offline":
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("TRANSFORMERS_OFFLINE", None)
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"  # a hub that cannot be reached, as without network
        args += ["--target", "someorg/some-model"]
    else:
        dist = tmp_path / "specdraft_bad_import-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: specdraft-bad-import\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text("[specdraft]\nbad_import = specdraft_bad_import_mod\n")
        (tmp_path / "specdraft_bad_import_mod.py").write_text("import not_installed_pkg\n")
        env["PYTHONPATH"] = str(tmp_path)
        args += ["--drafter", "bad-import"]
    out = subprocess.run([sys.executable, "-m", "specdraft.cli", *args], capture_output=True, text=True, env=env,
                         timeout=300)
    line = _one_line_error(out)
    assert message.format(d=tmp_path, port=port) in line, line
    assert "Retrying" not in out.stderr and "huggingface-cli download" not in line


def test_version():
    import importlib.metadata

    out = run("--version")
    assert out.returncode == 0 and out.stdout == f"specdraft {importlib.metadata.version('specdraft')}\n"
