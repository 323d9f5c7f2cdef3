"""Ctrl-C keeps what was generated; text cut by the token limit never ends in half a character."""

from __future__ import annotations

import pytest

from specdraft import SpeculativeDecoder, hookimpl
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import GenerationInterrupted
from specdraft.engine.output import INCOMPLETE, output_text

pytestmark = pytest.mark.e2e

PROMPT = "List the days of the week, then list them again."


class InterruptingDrafter(PromptLookupDrafter):
    """Prompt lookup, until its fifth proposal, where the user presses Ctrl-C."""

    def reset(self):
        super().reset()
        self.calls = 0

    def propose(self, ctx, k):
        self.calls += 1
        if self.calls == 5:
            raise KeyboardInterrupt
        return super().propose(ctx, k)


class _Plugin:
    @hookimpl
    def register_drafters(self, register):
        register("interrupting", InterruptingDrafter)


def test_ctrl_c_in_generate_prints_what_was_generated(register_plugin, capsys, default_f32, cached_default_model):
    from specdraft.cli import main

    register_plugin(_Plugin(), "interrupting-plugin")
    model, tokenizer = default_f32
    full = SpeculativeDecoder(model, tokenizer, drafter="prompt-lookup").generate(PROMPT, max_new_tokens=64)[0].text
    assert main(["generate", "--drafter", "interrupting", "--fixed-spec-length", "--max-new-tokens", "64",
                 PROMPT]) == 130
    out = capsys.readouterr()
    printed = out.out.rstrip("\n")
    assert printed and full.startswith(printed) and len(printed) < len(full)
    assert out.err.strip() == "specdraft: interrupted"


def test_interrupted_results_reach_the_api(register_plugin, default_f32):
    register_plugin(_Plugin(), "interrupting-plugin")
    model, tokenizer = default_f32
    dec = SpeculativeDecoder(model, tokenizer, drafter="interrupting", adaptive=False)
    with pytest.raises(GenerationInterrupted) as caught:  # a KeyboardInterrupt, with the results so far
        dec.generate([PROMPT, "Count to twenty."], max_new_tokens=64)
    assert isinstance(caught.value, KeyboardInterrupt)
    for r in caught.value.results:
        assert r.finish_reason == "interrupted" and 0 < len(r.token_ids) < 64


def test_text_cut_inside_a_character_drops_the_half_character(default_f32):
    _, tokenizer = default_f32
    ids = tokenizer("Smile: 😀 and 日本語", add_special_tokens=False).input_ids
    cuts = [n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(INCOMPLETE)]
    assert cuts, "the byte-level tokenizer splits these characters over several tokens"
    for n in cuts:
        text = output_text(tokenizer, ids[:n], "length")
        assert not text.endswith(INCOMPLETE) and tokenizer.decode(ids[:n]).startswith(text)
    assert output_text(tokenizer, ids, "length") == "Smile: 😀 and 日本語"
