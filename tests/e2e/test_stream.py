"""Streaming on the real default model: the bursts add up to generate()'s text."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdraft import SpeculativeDecoder

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("stop", [None, ["\n"], ["the", "Canberra"]])
def test_stream_concatenation_equals_generate(default_f32, prompts, stop):
    model, tokenizer = default_f32
    dec = SpeculativeDecoder(model, tokenizer, drafter="prompt-lookup", spec_length=4)
    for prompt in prompts.values():
        expected = dec.generate(prompt, max_new_tokens=48, stop=stop)[0]
        stream = dec.stream(prompt, max_new_tokens=48, stop=stop)
        chunks = list(stream)
        assert "".join(c.text for c in chunks) == expected.text == stream.result.text
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert stream.result.finish_reason == expected.finish_reason
        assert any(len(c.token_ids) > 1 for c in chunks) == (stream.result.stats.accepted_tokens > 0)  # bursts


def test_generate_stream_prints_as_it_goes():
    out = subprocess.run([sys.executable, "-m", "specdraft.cli", "generate", "--stream", "--drafter", "prompt-lookup",
                          "--max-new-tokens", "24", "Repeat exactly: one two three four five six"],
                         capture_output=True, text=True, timeout=300)
    plain = subprocess.run([sys.executable, "-m", "specdraft.cli", "generate", "--drafter", "prompt-lookup",
                            "--max-new-tokens", "24", "Repeat exactly: one two three four five six"],
                           capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout == plain.stdout and out.stdout.strip()
