"""Every registered drafter (built-in or installed plugin) through the conformance suite."""

from __future__ import annotations

import pytest

from specdraft import SpeculativeDecoder
from specdraft.errors import ConfigError, ModelLoadError
from specdraft.plugins import get_registry
from specdraft.testing import check_drafter, random_heads, tiny_llama


def _draft_model(model, path):
    """A saved 1-layer random Llama over the target's vocabulary, to draft with."""
    tiny_llama(vocab_size=64, seed=7, layers=1).save_pretrained(path)
    return {"model": str(path), "dtype": "float64"}


def _heads(kind):
    """Random heads of ``kind`` over half the vocabulary (trimmed), with a copy gate: every part runs."""

    def make(model, path):
        import torch

        random_heads(kind, model, path, head_ids=torch.arange(0, 64, 2), copy_gate=True)
        return {"heads": str(path)}

    return make


#: drafter -> ``make(tiny_model, tmp_path)`` -> the options it needs to start on the tiny target.
#: A drafter that needs options and is not here fails the test: add it.
OPTIONS = {
    "draft-model": _draft_model,
    "llama-1b": _draft_model,  # draft-model whose default model (Llama-3.2-1B) no test machine has
    "medusa": _heads("medusa"),
    "eagle": _heads("eagle"),
    "eagle3": _heads("eagle3"),  # a draft vocabulary of half the tokens (d2t), with a copy gate
    "mlp-speculator": _heads("mlp-speculator"),
    # plugins/specdraft-adaptive-lookup (CI installs it): a short start and cap, so it grows and shrinks
    "adaptive-lookup": lambda model, path: {"start": 1, "max_length": 6},
}


#: drafters registered under a name of their own with other defaults only (the same class): their
#: conformance is the other drafter's, which runs here too
SAME_AS = {"llama-1b": "draft-model"}


@pytest.mark.parametrize("name", get_registry().names())
def test_registered_drafter_conforms(tiny_model, tmp_path, name):
    """Every drafter registered (built-in or installed plugin) passes ``check_drafter``; none is
    skipped (one that is another's class under other defaults is shown to be that, and to start)."""
    if name in SAME_AS:
        registry = get_registry()
        spec, same = registry.get(name), registry.get(SAME_AS[name])
        assert spec.cls is same.cls and spec.options is same.options and spec.plugin == same.plugin
        with SpeculativeDecoder(tiny_model, None, drafter=name, drafter_options=OPTIONS[name](tiny_model, tmp_path)) \
                as dec:
            assert type(dec.drafter) is same.cls and dec.generate_ids([[1, 2, 3]], max_new_tokens=4)[0].token_ids
        return
    if name not in OPTIONS:
        try:
            SpeculativeDecoder(tiny_model, None, drafter=name)
        except (ConfigError, ModelLoadError) as exc:
            pytest.fail(f"{name} cannot start on the tiny model without options ({exc}); add the options it "
                        f"needs to OPTIONS in {__file__}")
    options = OPTIONS[name](tiny_model, tmp_path) if name in OPTIONS else None
    check_drafter(name, tiny_model, drafter_options=options)


def _self_drafter(model, report, honest: bool):
    """Drafts one token per round from the target's own logits at the row's context: it reports
    ``report(logits, ctx)`` and draws from it when ``honest``, else takes its most likely token."""
    import torch

    from specdraft import Draft, Drafter
    from specdraft.testing.drafters import last_logits

    class SelfDrafter(Drafter):
        def propose(self, ctx, k):
            logits = last_logits(model, ctx.token_ids)  # [batch, vocab]
            if ctx.sampling.greedy:
                return Draft(token_ids=logits.argmax(-1)[:, None])
            probs = report(logits, ctx)  # [batch, vocab]
            tokens = (torch.multinomial(probs, 1, generator=ctx.generator) if honest
                      else probs.argmax(-1, keepdim=True))
            return Draft(token_ids=tokens, probs=probs[:, None])

    return SelfDrafter(None, None)


def test_the_suite_catches_a_drafter_that_skips_the_filters(tiny_model):
    """Reporting (and drawing from) its raw softmax, not the pipeline's output: still exact, but
    it drafts tokens the filters remove (the suite's top-k check)."""
    drafter = _self_drafter(tiny_model, lambda logits, ctx: logits.softmax(-1), honest=True)
    with pytest.raises(AssertionError, match="more than top_k"):
        check_drafter(drafter, tiny_model, spec_lengths=(3,))


def test_the_suite_passes_the_same_drafter_when_it_reports_the_pipeline(tiny_model):
    from specdraft import logits_to_probs

    drafter = _self_drafter(tiny_model, lambda logits, ctx: logits_to_probs(logits, ctx.sampling, ctx.counts_after()),
                            honest=True)
    check_drafter(drafter, tiny_model, spec_lengths=(3,))


def test_the_suite_catches_a_drafter_that_misreports_its_distribution(tiny_model):
    """Drafting the most likely token but reporting the distribution (a classic bug): not exact."""
    from specdraft import logits_to_probs

    drafter = _self_drafter(tiny_model, lambda logits, ctx: logits_to_probs(logits, ctx.sampling, ctx.counts_after()),
                            honest=False)
    with pytest.raises(AssertionError, match="does not follow the target's distribution"):
        check_drafter(drafter, tiny_model, spec_lengths=(3,))


def test_the_suite_catches_a_drafter_that_assumes_one_setting_per_batch(tiny_model):
    """Reading ``ctx.sampling.temperature`` works while every row shares its settings; under
    continuous batching a greedy request shares rounds with a sampled one and it raises."""
    from specdraft import Draft, Drafter

    class OneSettingDrafter(Drafter):
        api_version = 2

        def propose(self, ctx, k):
            if ctx.sampling.temperature > 0:
                return Draft.empty(ctx.batch_size)
            return Draft.from_lists([t[-1:] for t in ctx.token_ids])

    with pytest.raises(AssertionError, match="continuous batching.*rows have different sampling settings"):
        check_drafter(OneSettingDrafter(None, None), tiny_model, spec_lengths=(3,), samples=0)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", get_registry().names())
def test_a_round_copies_to_the_host_once(tiny_model, tmp_path, name, sampled, monkeypatch):
    """Every drafter's engine round (draft, verify, accept, commit) asks for at most one
    device-to-host copy: the verifier's Outcome. Counted on CPU, where each would be a host sync
    on a GPU (specdraft.testing.syncs), over batches of three rows, greedy and sampled."""
    from specdraft.engine.engine import Engine
    from specdraft.testing import repetitive_prompts
    from specdraft.testing.syncs import HostSyncs

    rounds, run_round = [], Engine._round

    def counted(self, batch):
        with HostSyncs() as syncs:
            run_round(self, batch)
        rounds.append(syncs.where)

    monkeypatch.setattr(Engine, "_round", counted)
    options = OPTIONS[name](tiny_model, tmp_path) if name in OPTIONS else None
    dec = SpeculativeDecoder(tiny_model, None, drafter=name, spec_length=3, adaptive=False, drafter_options=options)
    dec.generate_ids(repetitive_prompts(64, seed=0)[:3], max_new_tokens=12,
                     **({"temperature": 0.8, "seed": 1} if sampled else {}))
    assert len(rounds) >= 3
    worst = max(rounds, key=lambda where: sum(where.values()))
    assert sum(worst.values()) <= 1, f"a round copied to the host {sum(worst.values())} times: {dict(worst)}"
