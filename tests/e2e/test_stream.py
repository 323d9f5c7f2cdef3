"""Streaming on the real default model: the bursts add up to generate()'s text."""

from __future__ import annotations

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
        # bursts: a round that committed more than one token (not "accepted > 0": a stop string can
        # cut a round's accepted tokens off, and the round then commits one)
        stats = stream.result.stats
        assert any(len(c.token_ids) > 1 for c in chunks) == (stats.new_tokens > stats.target_passes)


def test_generate_stream_prints_as_it_goes(cli, monkeypatch):
    """``specdraft generate --stream`` prints burst after burst, in all the text plain ``generate`` prints."""
    import builtins

    import specdraft.cli

    args = ["generate", "--drafter", "prompt-lookup", "--max-new-tokens", "24", "--dtype", "float64",
            "Repeat exactly: one two three four five six"]
    code, plain, err = cli(*args)
    assert code == 0 and plain.strip(), err
    printed = []
    monkeypatch.setattr(specdraft.cli, "print", lambda *a, **k: printed.append(a) or builtins.print(*a, **k),
                        raising=False)
    code, streamed, err = cli(args[0], "--stream", *args[1:])
    assert code == 0 and streamed == plain, err
    assert len([a for a in printed if a and a[0]]) > 1  # several bursts, each printed as it came
