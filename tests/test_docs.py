"""Docs that quote the program must match it."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdraft.cli import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("command", ["generate", "bench", "distill", "train-heads", "drafters"])
def test_cli_reference_quotes_the_real_help(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = capsys.readouterr().out.replace("python -m pytest", "specdraft")
    help_text = help_text.replace(f"usage: {build_parser().prog}", "usage: specdraft")
    assert help_text.strip() in (DOCS / "cli.md").read_text(), f"docs/cli.md is out of date for `{command}`: run scripts/cli-docs.sh"


def test_docs_exist_and_link_the_example_plugin():
    tutorial = (DOCS / "writing-a-drafter.md").read_text()
    assert "plugins/specdraft-adaptive-lookup" in tutorial
    plugin_source = Path(__file__).resolve().parents[1] / "plugins/specdraft-adaptive-lookup/src/specdraft_adaptive_lookup/__init__.py"
    # every line of the tutorial's class skeleton up to `on_verified` is the real code
    for line in ['register("adaptive-lookup", AdaptiveLookupDrafter, aliases=("alookup",))',
                 "want = min(k, self.lengths.setdefault(b, o.start))",
                 'start: int = Field(3, ge=1, description="draft length of a new sequence")']:
        assert line in tutorial and line in plugin_source.read_text()
    for page in ["getting-started.md", "algorithm.md", "cli.md"]:
        assert (DOCS / page).stat().st_size > 500
