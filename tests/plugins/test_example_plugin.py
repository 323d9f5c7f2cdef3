"""The example package in plugins/ as a user would install it (CI installs it). Its
``check_drafter`` run is the registry-wide one in tests/drafters/test_conformance.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdraft import SpeculativeDecoder
from specdraft.testing import plain_greedy, repetitive_prompts

pytest.importorskip(
    "specdraft_adaptive_lookup", reason="install it: pip install -e plugins/specdraft-adaptive-lookup"
)


def test_cli_lists_the_plugin_drafter():
    out = subprocess.run([sys.executable, "-m", "specdraft.cli", "drafters", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    listed = {d["name"]: d for d in json.loads(out.stdout)["drafters"]}
    assert listed["adaptive-lookup"]["plugin"] == "specdraft-adaptive-lookup"
    assert listed["adaptive-lookup"]["aliases"] == ["alookup"]


def test_plugin_draft_length_adapts(tiny_model):
    """The plugin's own draft length moves away from its start value as rounds are accepted
    (it grows by 2) or rejected (it shrinks by 1); the sequence's state goes when it leaves."""
    motif = [5, 6, 7, 8, 9, 10]
    prompt = motif * 4
    dec = SpeculativeDecoder(tiny_model, None, drafter="alookup", spec_length=8, drafter_options={"start": 4},
                             adaptive=False)
    at_leave = []
    leave = dec.drafter.on_leave
    dec.drafter.on_leave = lambda seq_id: at_leave.append(dec.drafter.lengths.get(seq_id)) or leave(seq_id)
    r = dec.generate_ids([prompt], max_new_tokens=30)[0]
    assert r.token_ids == plain_greedy(tiny_model, prompt, 30)
    assert r.stats.drafted_tokens > 0
    assert len(at_leave) == 1 and at_leave[0] not in (None, 4)
    assert dec.drafter.lengths == {}


def test_plugin_keeps_each_sequence_length_as_others_join_and_leave(tiny_model):
    """Two slots, five sequences of different budgets: each is exact, the drafter's lengths are
    keyed by sequence (never more entries than sequences running) and empty at the end."""
    prompts = repetitive_prompts(64) + [[5, 6, 7, 8, 9, 10] * 3]
    budgets = [6, 20, 3, 12, 16]
    dec = SpeculativeDecoder(tiny_model, None, drafter="adaptive-lookup", spec_length=4, max_batch=2,
                             drafter_options={"start": 2}, adaptive=False)
    tracked = []
    verified = dec.drafter.on_verified
    dec.drafter.on_verified = lambda ctx, n: tracked.append(set(dec.drafter.lengths) - set(ctx.seq_ids)) or \
        verified(ctx, n)
    streams = [dec.stream_ids(p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    for p, n, s in zip(prompts, budgets, streams):
        assert [t for chunk in s for t in chunk.token_ids] == plain_greedy(tiny_model, p, n)
    assert tracked and not any(tracked)  # no state of a sequence that is not running
    assert dec.drafter.lengths == {}
