"""The CLI as a user runs it: plain decoding's text, the Python API's stats, one line on bad input.

Two tests start ``specdraft`` in a fresh process, as a user does (a generation, and an error's one
line and exit code); the others call ``specdraft.cli.main`` here, on the session's loaded model (the
``cli`` fixture), since arguments, output and messages are the same in process. Bad arguments and
settings, which fail before any model loads, are in ``tests/test_cli_inputs.py``.
"""

from __future__ import annotations

import subprocess

import pytest

from specdraft import SpeculativeDecoder
from specdraft.testing import commands

pytestmark = pytest.mark.e2e



def specdraft_command(*args):
    """``specdraft ARGS`` in a fresh process: the installed script, else ``python -m specdraft.cli``."""
    return subprocess.run([*commands.specdraft_command(), *args], capture_output=True, text=True, timeout=300)


def test_specdraft_generate_in_a_fresh_process(days):
    """The installed command loads the default model itself and prints plain decoding's text."""
    out = specdraft_command("generate", "--drafter", "ngram", "--dtype", "float64", "--max-new-tokens", str(days.new), days.prompt)
    assert out.returncode == 0, out.stderr
    assert out.stdout == days.plain.text + "\n" and "Monday" in out.stdout


def test_bad_input_in_a_fresh_process_is_one_line_and_exit_2(tmp_path):
    """What a user sees: exit code 2 and one line, no traceback (transformers imported, nothing loaded)."""
    (tmp_path / "config.json").write_text('{"a": 1,, }')
    out = specdraft_command("generate", "--target", str(tmp_path), "hi")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"specdraft: error: {str(tmp_path / 'config.json')!r} is not valid JSON (Expecting "
                          "property name enclosed in double quotes: line 1 column 9 (char 8)); fix or replace that "
                          "file\n")


@pytest.mark.parametrize("name, value", [("SPECDRAFT_CPU_PRODUCTS", "amx"), ("SPECDRAFT_BF16_PAIRS", "yes"),
                                         ("SPECDRAFT_PREFETCH", "L2")])
def test_a_cpu_kernel_setting_it_does_not_know_is_one_line_and_exit_2(monkeypatch, name, value):
    """The C++ operators' variables, read when the model loads: a value they do not know is the
    CLI's one line, saying which values they take, not a traceback."""
    monkeypatch.setenv(name, value)
    out = specdraft_command("generate", "--max-new-tokens", "1", "hi")
    assert out.returncode == 2 and out.stdout == "", out.stderr[-2000:]
    assert out.stderr.startswith(f"specdraft: error: {name}={value!r}: set it to ") and out.stderr.count("\n") == 1


@pytest.mark.parametrize("drafter", ["ngram", "draft-model", "medusa", "eagle", "mlp-speculator"])
def test_generate_prints_plain_text_and_the_apis_stats(cli, monkeypatch, days, drafter):
    """Built-in and shipped learnt drafters, offline: stdout is plain greedy decoding's text, stderr
    the stats of the result the Python API returned to the CLI, field for field."""
    runs = []  # (decoder, results) of each generate() call
    generate = SpeculativeDecoder.generate
    monkeypatch.setattr(SpeculativeDecoder, "generate",
                        lambda self, *a, **k: runs.append((self, generate(self, *a, **k))) or runs[-1][1])
    code, out, err = cli("generate", "--drafter", drafter, "--fixed-spec-length", "--dtype", "float64", "--stats",
                         "--max-new-tokens", str(days.new), days.prompt)
    assert code == 0, err
    assert out == days.plain.text + "\n"
    [(decoder, [result])] = runs
    stats = result.stats
    assert stats.new_tokens == len(days.plain.token_ids) and 0 < stats.accepted_tokens <= stats.drafted_tokens
    by_position = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
    lines = err.splitlines()
    assert len(lines) == 8, err
    assert lines[0] == (f"drafter: {decoder.drafter.name or drafter}  spec_length: 4  target: specdraft model code, "
                        "eager, unquantized weights, float64 (asked for)")
    assert lines[1].startswith(f"new tokens: {stats.new_tokens}  time: ")
    assert lines[2] == f"target passes: {stats.target_passes}  tokens per pass: {stats.tokens_per_pass:.2f}"
    assert lines[3] == (f"drafted: {stats.drafted_tokens}  accepted: {stats.accepted_tokens}  "
                        f"acceptance rate: {stats.acceptance_rate:.3f}")
    assert lines[4].startswith(f"rounds that drafted: {stats.drafts}  draft nodes per round: "
                               f"{stats.nodes_per_draft:.2f} ")
    assert lines[5] == f"acceptance by position (tree depth): {by_position}"
    assert lines[7] == f"prompt tokens: {stats.prompt_tokens}  from the prefix cache: 0"  # a fresh decoder


def test_generate_reads_stdin_and_honours_raw(cli, default_f64):
    code, out, err = cli("generate", "--raw", "--max-new-tokens", "5", "--drafter", "prompt-lookup", "--dtype",
                         "float64", "-", stdin="One, two, three,")
    assert code == 0, err
    model, tokenizer = default_f64
    plain = SpeculativeDecoder(model, tokenizer, drafter="none")
    raw = plain.generate("One, two, three,", max_new_tokens=5, raw=True)[0].text
    assert out == raw + "\n"
    assert raw != plain.generate("One, two, three,", max_new_tokens=5)[0].text  # the chat template's answer


def _one_line_error(code, out, err) -> str:
    assert code == 2 and out == "", err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specdraft: error: "), err
    return lines[0]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BROKEN = [  # (case, what its one line says)
    ("prompt-too-long", "tokens but the model's context holds 8192; shorten it to at most 8191 tokens"),
    ("heads-missing", "heads folder './no/such/dir' does not exist; pass --drafter-option heads=DIR"),
    ("truncated-gguf", "GGUF file '{d}/half.gguf' is truncated or corrupt ("),
    ("draft-empty-folder", "draft model: '{d}/empty' is not a model folder: it is empty"),
    ("no-tokenizer", "model folder '{d}/notok' has no tokenizer files: add the tokenizer of the model it comes from "
                     "(tokenizer.json and tokenizer_config.json"),
    ("hub-offline", "model 'someorg/some-model' is not (fully) in the Hugging Face cache and the hub "
                    "(http://127.0.0.1:{port}) cannot be reached. Point --target at a local copy"),
    ("corrupt-safetensors", "could not load model folder '{d}/bad': its weights file model.safetensors is not a "
                            "complete safetensors file (Error while deserializing header: header too large): it is "
                            "truncated or corrupt; download or copy it again"),
    ("pickle-weights", "could not load model folder '{d}/bad': its weights file pytorch_model.bin is a pickle "
                       "holding Python objects besides tensors (fractions.Fraction), which torch does not load "
                       "safely; use a safetensors copy of it"),
    ("pickle-heads", "heads/pytorch_model.bin is a pickle holding Python objects besides tensors (fractions.Fraction)"),
    ("plugin-import", "unknown drafter 'bad-import': plugin 'specdraft-bad-import', which would provide it, failed to "
                      "import 'specdraft_bad_import_mod': ModuleNotFoundError: No module named 'not_installed_pkg'"),
]


@pytest.mark.parametrize("case, message", BROKEN, ids=[case for case, _ in BROKEN])
def test_broken_inputs_models_and_plugins_say_what_is_wrong(cli, tmp_path, monkeypatch, case, message):
    """Input the loaded model rejects, local paths that exist but are broken, a hub id without network
    (HF_HUB_OFFLINE off: one probe of a closed port), a plugin that failed to import: one line each,
    saying what is wrong."""
    monkeypatch.chdir(tmp_path)
    args, stdin = ["generate", "--max-new-tokens", "2", "hi"], None
    port = _closed_port()
    if case == "prompt-too-long":
        args, stdin = ["generate", "--raw", "-"], "word " * 9000
    elif case == "heads-missing":
        args += ["--drafter", "eagle", "--drafter-option", "heads=./no/such/dir"]
    elif case == "truncated-gguf":
        from specdraft.models import default_gguf_path

        with open(default_gguf_path(), "rb") as f:  # a download cut short
            (tmp_path / "half.gguf").write_bytes(f.read(2_000_000))
        args += ["--target", str(tmp_path / "half.gguf")]
    elif case == "draft-empty-folder":
        (tmp_path / "empty").mkdir()
        args += ["--drafter", "draft-model", "--drafter-option", f"model={tmp_path / 'empty'}"]
    elif case == "no-tokenizer":
        from specdraft.testing import tiny_llama

        tiny_llama(vocab_size=64, seed=0, layers=1).save_pretrained(tmp_path / "notok")
        args += ["--target", str(tmp_path / "notok")]
    elif case in ("corrupt-safetensors", "pickle-weights"):  # a good config and tokenizer, broken weights
        import fractions
        import shutil

        import torch

        from specdraft.models import resolve_target

        shutil.copytree(resolve_target(None)[1], tmp_path / "bad", ignore=shutil.ignore_patterns("*.safetensors"))
        if case == "corrupt-safetensors":
            (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 7 + b"\x7f" + b"{}")  # a huge header size
        else:  # torch.load(weights_only=True) refuses it: it would run code to build a Fraction
            torch.save({"x": fractions.Fraction(1, 3)}, tmp_path / "bad" / "pytorch_model.bin")
        args += ["--target", str(tmp_path / "bad")]
    elif case == "pickle-heads":
        import fractions

        import torch

        (tmp_path / "heads").mkdir()
        (tmp_path / "heads" / "config.json").write_text('{"hidden_size": 576}')
        torch.save({"fc.weight": fractions.Fraction(1, 3)}, tmp_path / "heads" / "pytorch_model.bin")
        args += ["--drafter", "eagle", "--drafter-option", "heads=./heads"]
    elif case == "hub-offline":
        import huggingface_hub.constants

        from specdraft import models

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")  # no network
        monkeypatch.setattr(models, "_hub_reachable", models._hub_reachable.__wrapped__)  # probe now, uncached
        args += ["--target", "someorg/some-model"]
    else:
        from specdraft import plugins

        dist = tmp_path / "specdraft_bad_import-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: specdraft-bad-import\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text("[specdraft]\nbad_import = specdraft_bad_import_mod\n")
        (tmp_path / "specdraft_bad_import_mod.py").write_text("import not_installed_pkg\n")
        monkeypatch.syspath_prepend(str(tmp_path))  # installed, as far as importlib.metadata can tell
        monkeypatch.setattr(plugins, "load_errors", [])
        monkeypatch.setattr(plugins, "entry_point_names", {})
        args += ["--drafter", "bad-import"]
    line = _one_line_error(*cli(*args, stdin=stdin))
    assert message.format(d=tmp_path, port=port) in line, line
    assert "huggingface-cli download" not in line
