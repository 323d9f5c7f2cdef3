"""``specdraft generate --response-format / --json-schema / --regex``: bad input is one line and
exit 2 before any model loads (the flags on the real model: tests/e2e/test_structured_e2e.py)."""

from __future__ import annotations

import json

import pytest

from specdraft.cli import main

pytest.importorskip("llguidance", reason="structured output needs pip install 'specdraft[structured]'")


@pytest.fixture(autouse=True)
def no_model(monkeypatch, tmp_path):
    def load_target(*args, **kwargs):
        pytest.fail("the model was loaded before the bad input was reported")

    monkeypatch.setattr("specdraft.models.load_target", load_target)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "schema.json").write_text(json.dumps({"type": "object"}))
    (tmp_path / "bad.json").write_text(json.dumps({"type": "nonsense"}))
    (tmp_path / "format.json").write_text(json.dumps({"type": "json_schema", "json_schema": {"schema": []}}))


@pytest.mark.parametrize("args, message", [
    (["--regex", "(yes"], "--regex: invalid regex: "),
    (["--json-schema", "bad.json"], "--json-schema: invalid json schema: Invalid type: nonsense"),
    (["--json-schema", "nope.json"], "--json-schema nope.json: cannot read it"),
    (["--response-format", "format.json"],
     "--response-format format.json: response_format.json_schema.schema: a JSON schema must be"),
    (["--response-format", "json_object", "--regex", "a"], "--regex: cannot be combined with --response-format"),
    (["--json-schema", "schema.json", "--ignore-eos"], "--ignore-eos cannot be combined with --json-schema"),
])
def test_bad_structured_output_flags(capsys, args, message):
    assert main(["generate", "hi", *args]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith(f"specdraft: error: {message}"), lines


def test_without_llguidance_the_error_says_what_to_install(capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name == "llguidance":
            raise ImportError("No module named 'llguidance'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    assert main(["generate", "hi", "--response-format", "json_object"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("specdraft: error: --response-format: structured output needs the llguidance package, which is not "
                   "installed: pip install 'specdraft[structured]'")
