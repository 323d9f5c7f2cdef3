"""The example package in plugins/ as a user would install it (CI installs it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdraft import SpeculativeDecoder
from specdraft.testing import check_drafter, plain_greedy, repetitive_prompts

pytest.importorskip(
    "specdraft_adaptive_lookup", reason="install it: pip install -e plugins/specdraft-adaptive-lookup"
)


def test_cli_lists_the_plugin_drafter():
    out = subprocess.run([sys.executable, "-m", "specdraft.cli", "drafters", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    listed = {d["name"]: d for d in json.loads(out.stdout)["drafters"]}
    assert listed["adaptive-lookup"]["plugin"] == "specdraft-adaptive-lookup"
    assert listed["adaptive-lookup"]["aliases"] == ["alookup"]


def test_plugin_drafter_is_exact(tiny_model):
    check_drafter("adaptive-lookup", tiny_model, drafter_options={"start": 1, "max_length": 6})


def test_plugin_draft_length_adapts(tiny_model):
    """The plugin's own draft length moves away from its start value as rounds are accepted
    (it grows by 2) or rejected (it shrinks by 1)."""
    motif = [5, 6, 7, 8, 9, 10]
    prompt = motif * 4
    dec = SpeculativeDecoder(tiny_model, None, drafter="alookup", spec_length=8, drafter_options={"start": 4},
                             adaptive=False)
    r = dec.generate_ids([prompt], max_new_tokens=30)[0]
    assert r.token_ids == plain_greedy(tiny_model, prompt, 30)
    assert r.stats.drafted_tokens > 0
    assert dec.drafter.lengths[0] != 4
