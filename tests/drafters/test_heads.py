"""medusa, eagle and mlp-speculator: hidden-state plumbing, exactness, formats, training."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specdraft import ConfigError, Draft, Drafter, SamplingParams, SpeculativeDecoder
from specdraft.drafters.heads.formats import load_heads
from specdraft.drafters.heads.modules import KINDS, EagleDraft, MedusaHeads, build_heads, causal_mask
from specdraft.testing import SIGNIFICANCE as ALPHA
from specdraft.testing import (
    check_drafter,
    plain_greedy,
    random_heads,
    repetitive_prompts,
    sampled_joint_pvalue,
    tiny_llama,
)
from specdraft.training.data import target_features
from specdraft.training.heads import feature_layers, heads_loss
from specdraft.training.loop import train


class RecordingDrafter(Drafter):
    """Asks for hidden states, records them, and proposes (mostly wrong) tokens."""

    api_version = 1  # records by row index: one wave, every row from start to end
    needs_hidden_states = True

    def __init__(self):
        super().__init__(None, None)

    def reset(self):
        self.states = None

    def on_hidden_states(self, ctx, hidden_states):
        if self.states is None:
            self.states = [[] for _ in hidden_states]
        for rows, h in zip(self.states, hidden_states):
            rows.append(h.clone())

    def propose(self, ctx, k):
        rng = random.Random(sum(map(len, ctx.token_ids)))
        return Draft.from_lists([[t[-1]] + [rng.randrange(ctx.vocab_size) for _ in range(k - 1)]
                                 for t in ctx.token_ids])


def test_hidden_states_equal_a_fresh_forward_over_the_accepted_sequence(tiny_model):
    prompts = repetitive_prompts(64, seed=3)
    drafter = RecordingDrafter()
    dec = SpeculativeDecoder(tiny_model, None, drafter=drafter, spec_length=3, adaptive=False)  # always drafts
    results = dec.generate_ids(prompts, max_new_tokens=25)
    for b, (prompt, r) in enumerate(zip(prompts, results)):
        tokens = prompt + r.token_ids
        seen = torch.cat(drafter.states[b])  # [positions, hidden]
        assert seen.shape[0] == len(tokens) - 1  # every position but the last one, each exactly once
        with torch.no_grad():
            fresh = tiny_model.model(torch.tensor([tokens])).last_hidden_state[0, :-1]
        torch.testing.assert_close(seen, fresh, rtol=1e-9, atol=1e-9)
    assert sum(r.stats.accepted_tokens for r in results) > 0  # partial acceptance happened


def test_drafters_that_do_not_ask_pay_nothing(tiny_model):
    """The target's passes return hidden states only for a drafter with the flag."""
    asked = []

    def record(dec):
        forward = dec.runner.forward
        dec.runner.forward = lambda tokens, **kw: asked.append(kw.get("hidden", False)) or forward(tokens, **kw)
        return dec

    record(SpeculativeDecoder(tiny_model, None, drafter="ngram")).generate_ids(repetitive_prompts(64), max_new_tokens=10)
    assert asked and not any(asked)
    asked.clear()
    record(SpeculativeDecoder(tiny_model, None, drafter=RecordingDrafter())).generate_ids([[1, 2, 3]], max_new_tokens=4)
    assert asked and all(asked)  # the same path with a drafter that asks gets them on every pass


# -- trained tiny heads: greedy parity with real acceptance ------------------------------------

def _tiny_sequences(model, n=48, length=40, seed=0):
    """The tiny model's own greedy continuations of random prompts (its "answers")."""
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        # no token 0: it is the tiny model's pad id, which transformers' generate would mask out
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(3, 10))]
        out.append({"ids": prompt + plain_greedy(model, prompt, length - len(prompt)), "prompt_len": len(prompt)})
    return out


def _train_heads(model, kind, work, seqs, steps=80):
    """Heads of ``kind`` trained on ``seqs``, ``model``'s own outputs (:func:`_tiny_sequences`; soft
    labels for the last quarter)."""
    from specdraft.drafters.common.compact_draft import target_fingerprint
    from specdraft.drafters.heads.formats import save_heads
    from specdraft.drafters.heads.modules import SharedHead
    from specdraft.training.batches import padded_batch

    head = SharedHead(model.lm_head, model.config.vocab_size)
    torch.manual_seed(0)
    module = build_heads(kind, model.config, num_heads=3, num_stages=3).double()
    states = target_features(model, seqs, progress=False,  # eagle3: its layers' states and the final-norm ones
                             layers=feature_layers(kind, getattr(module, "aux_layers", ()), model.config.num_hidden_layers))
    rng = random.Random(1)

    def loss_fn(step):
        picked = rng.sample(range(len(seqs)), 8)
        batch = padded_batch([seqs[i] for i in picked], [states[i] for i in picked], torch.float64, "cpu")
        return heads_loss(kind, module, head, model.get_input_embeddings(), *batch, soft=step >= steps * 3 // 4)

    with torch.enable_grad():
        losses = train(dict(module.named_parameters()), loss_fn, steps, work, lr=3e-3, progress=False)
    path = save_heads(module.eval(), head, work / "heads", "tiny", target_fingerprint(model.model.embed_tokens.weight),
                      dtype=torch.float64)
    return str(path), losses


@pytest.fixture(scope="module")
def sharp_model():
    """The tiny model with a sharper LM head: confident, learnable next-token distributions."""
    model = tiny_llama(vocab_size=64, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def trained(sharp_model, tmp_path_factory):
    """Heads of each kind trained for 80 steps on the sharp tiny model, and their loss curves."""
    seqs = _tiny_sequences(sharp_model)  # once: the same answers for every kind
    return {kind: _train_heads(sharp_model, kind, tmp_path_factory.mktemp(kind), seqs) for kind in KINDS}


@pytest.fixture(scope="module")
def trained_small(small_vocab_model, tmp_path_factory):
    """Heads trained on the 16-token model: their drafts are accepted often, but not always."""
    seqs = _tiny_sequences(small_vocab_model)
    return {kind: _train_heads(small_vocab_model, kind, tmp_path_factory.mktemp(kind), seqs, steps=40)[0]
            for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_a_few_training_steps_lower_the_loss(trained, kind):
    losses = trained[kind][1]
    assert sum(losses[50:60]) / 10 < 0.9 * sum(losses[:10]) / 10  # phase 1 (hard labels) on text


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_parity_with_trained_heads(sharp_model, trained, kind, k):
    tiny_model = sharp_model
    prompts = repetitive_prompts(64, seed=5) + [s["ids"][: s["prompt_len"]] for s in _tiny_sequences(tiny_model, 4, seed=9)]
    dec = SpeculativeDecoder(tiny_model, None, drafter=kind, spec_length=k, adaptive=False,  # a fixed K, and
                             drafter_options={"heads": trained[kind][0], "min_confidence": 0.0})  # no early stop
    results = dec.generate_ids(prompts, max_new_tokens=30)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(tiny_model, p, 30)
    accepted = sum(r.stats.accepted_tokens for r in results)
    drafted = sum(r.stats.drafted_tokens for r in results)
    assert 0 < accepted < drafted  # both full and partial acceptance paths ran


@pytest.mark.parametrize("gate", [False])  # with the gate: the registry-wide run in test_conformance.py
@pytest.mark.parametrize("kind", KINDS)
def test_conformance_with_random_heads_and_a_trimmed_vocabulary(tiny_model, tmp_path, kind, gate):
    random_heads(kind, tiny_model, tmp_path, head_ids=torch.arange(0, 64, 2), copy_gate=gate)
    check_drafter(kind, tiny_model, drafter_options={"heads": str(tmp_path)})


# -- the copy gate ------------------------------------------------------------------------------

def _with_copy_gate(model, kind, path, out):
    """The heads in ``path`` plus a :func:`trusting_copy_gate`, saved to ``out``."""
    from specdraft.drafters.common.compact_draft import target_fingerprint
    from specdraft.drafters.heads.formats import save_heads
    from specdraft.testing import trusting_copy_gate

    module, shared, _ = load_heads(path, _target_info(model), kind)
    module.copy_gate = trusting_copy_gate(model.config.hidden_size, dtype=model.dtype)
    return str(save_heads(module, shared, out, "tiny", target_fingerprint(model.model.embed_tokens.weight),
                          dtype=model.dtype))


@pytest.fixture(scope="module")
def gated(sharp_model, trained, tmp_path_factory):
    return {kind: _with_copy_gate(sharp_model, kind, trained[kind][0], tmp_path_factory.mktemp(f"{kind}-gated"))
            for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_copy_gate_changes_the_heads_drafts(sharp_model, gated, kind):
    """The heads really draft from the copy mixture: on repetitive contexts the gated heads propose
    what followed the trailing n-gram where the heads alone propose something else."""
    from specdraft.drafters.api import prompt_lookup

    prompts = repetitive_prompts(64, seed=5)
    firsts = {}
    for on in (True, False):
        dec = SpeculativeDecoder(sharp_model, None, drafter=kind, spec_length=3, adaptive=False,
                                 drafter_options={"heads": gated[kind], "copy_gate": on})
        assert (dec.drafter.copier is not None) == on
        seen = []
        original = dec.drafter.propose

        def record(ctx, k):
            draft = original(ctx, k)
            seen.extend((list(t), int(d[0])) for t, d in zip(ctx.token_ids, draft.token_ids))
            return draft

        dec.drafter.propose = record
        dec.generate_ids(prompts, max_new_tokens=3)  # the first round drafts after each prompt
        firsts[on] = dict((tuple(t), d) for t, d in seen)
        assert firsts[on], "no round drafted"
    copied = {t: prompt_lookup(list(t), 1, 2, 3) for t in firsts[True]}
    assert any(c and t in firsts[False] and firsts[True][t] == c[0] != firsts[False][t] for t, c in copied.items())


@pytest.mark.parametrize("kind", KINDS)
def test_heads_copy_gate_learns_to_copy_where_answers_repeat_the_prompt(tiny_model, tmp_path, kind):
    """train-heads' last stage: fitted with the heads frozen, the gate's held-out guesses (through
    the gate, as the drafter chooses them) get right what the random heads alone get wrong."""
    from specdraft.training.copy_gate import fit_copy_gate
    from specdraft.training.evaluate import heads_predictor, held_out_acceptance
    from specdraft.training.heads import heads_gate_source

    g = torch.Generator().manual_seed(0)

    def sequence():
        prompt = torch.randint(1, 64, (12,), generator=g).tolist()
        return {"ids": prompt + prompt[:10], "prompt_len": 12, "greedy": True}

    train_seqs, held = [sequence() for _ in range(40)], [sequence() for _ in range(8)]
    random_heads(kind, tiny_model, tmp_path / "heads", num_heads=2, num_stages=2)
    module, head, _ = load_heads(tmp_path / "heads", _target_info(tiny_model), kind)
    layers = feature_layers(kind, getattr(module, "aux_layers", ()), tiny_model.config.num_hidden_layers)
    states, held_states = (target_features(tiny_model, s, progress=False, layers=layers) for s in (train_seqs, held))
    embeddings = tiny_model.get_input_embeddings()

    def acceptance():
        return held_out_acceptance(heads_predictor(kind, module, head, embeddings, 2), held, held_states, 2,
                                   dtype=torch.float64)

    before = acceptance()
    losses = fit_copy_gate(module, heads_gate_source(kind, module, head, embeddings), train_seqs, tmp_path / "gate",
                           states=states, steps=60, batch=256, progress=False, dtype=torch.float64)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    after = acceptance()
    assert after[0] > 0.8 > before[0] + 0.3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_parity_with_gated_heads(sharp_model, gated, kind, k):
    prompts = repetitive_prompts(64, seed=11) + [s["ids"][: s["prompt_len"]] for s in _tiny_sequences(sharp_model, 4, seed=9)]
    dec = SpeculativeDecoder(sharp_model, None, drafter=kind, spec_length=k, drafter_options={"heads": gated[kind]},
                             adaptive=False)
    assert dec.drafter.copier is not None
    results = dec.generate_ids(prompts, max_new_tokens=30)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(sharp_model, p, 30)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert 0 < accepted < sum(r.stats.drafted_tokens for r in results)


# -- sampling exactness -------------------------------------------------------------------------

#: each kind's sampling settings: every kind drafts through a different filter
HEAD_SAMPLING = {
    "medusa": SamplingParams(temperature=1.0, top_p=0.8),
    "eagle": SamplingParams(temperature=0.9, top_k=5),
    "eagle3": SamplingParams(temperature=1.1, top_k=7),
    "mlp-speculator": SamplingParams(temperature=0.8, top_k=6, top_p=0.9),
}


@pytest.mark.parametrize("gated", [False, True], ids=["heads", "gated-heads"])
@pytest.mark.parametrize("kind", KINDS)
def test_sampling_matches_target_joint_distribution(small_vocab_model, trained_small, tmp_path, kind, gated):
    """The first K + 1 = 4 sampled tokens against the target's exact distribution (chi-square at
    ALPHA, the power calculation's sample size). Gated: drafts from the copy mixture, with a head
    over 12 of the 16 tokens, so the candidate is sometimes a token the head gives probability 0."""
    heads = trained_small[kind]
    if gated:
        from specdraft.drafters.common.compact_draft import target_fingerprint
        from specdraft.drafters.heads.formats import save_heads
        from specdraft.drafters.heads.modules import SharedHead
        from specdraft.testing import trusting_copy_gate

        module, shared, _ = load_heads(heads, _target_info(small_vocab_model), kind)
        module.copy_gate = trusting_copy_gate(small_vocab_model.config.hidden_size, dtype=small_vocab_model.dtype)
        trimmed = SharedHead(small_vocab_model.lm_head, 16, torch.arange(12))
        heads = str(save_heads(module, trimmed, tmp_path / "gated", "tiny",
                               target_fingerprint(small_vocab_model.model.embed_tokens.weight),
                               dtype=small_vocab_model.dtype))
    dec = SpeculativeDecoder(small_vocab_model, None, drafter=kind, spec_length=3, max_batch=512,
                             drafter_options={"heads": heads})
    pvalue, results = sampled_joint_pvalue(dec, [3, 5, 3, 5, 3], HEAD_SAMPLING[kind], seed=17)
    drafted = sum(r.stats.drafted_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert drafted >= len(results) and 0 < accepted < drafted  # traffic on both paths
    assert pvalue > ALPHA


# -- formats ------------------------------------------------------------------------------------

def _target_info(model):
    return SpeculativeDecoder(model, None, drafter="none").target


@pytest.mark.parametrize("kind", KINDS)
def test_specdraft_format_round_trip(tiny_model, tmp_path, kind):
    random_heads(kind, tiny_model, tmp_path, seed=2, head_ids=torch.arange(10, 40))
    module, shared, meta = load_heads(tmp_path, _target_info(tiny_model), kind)
    assert meta["kind"] == kind and shared.head_ids.tolist() == list(range(10, 40))
    torch.manual_seed(2)
    fresh = build_heads(kind, tiny_model.config)
    assert set(module.state_dict()) == set(fresh.state_dict())
    logits = shared(torch.randn(2, 32, dtype=torch.float64))
    assert torch.isfinite(logits[:, 10:40]).all() and bool((logits[:, :10] < -1e300).all())


def test_heads_for_another_target_are_refused(tiny_model, tmp_path):
    other = tiny_llama(vocab_size=64, seed=5)
    random_heads("eagle", other, tmp_path)
    with pytest.raises(ConfigError, match=r"trained for target 'tiny'.*train-heads --kind eagle"):
        SpeculativeDecoder(tiny_model, None, drafter="eagle", drafter_options={"heads": str(tmp_path)})


def test_wrong_kind_and_missing_folder_say_what_to_do(tiny_model, tmp_path):
    random_heads("medusa", tiny_model, tmp_path)
    with pytest.raises(ConfigError, match="holds medusa heads, not eagle; use --drafter medusa"):
        SpeculativeDecoder(tiny_model, None, drafter="eagle", drafter_options={"heads": str(tmp_path)})
    with pytest.raises(ConfigError, match="does not exist; pass --drafter-option heads=DIR"):
        SpeculativeDecoder(tiny_model, None, drafter="medusa", drafter_options={"heads": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="no shipped heads for target"):
        SpeculativeDecoder(tiny_model, None, drafter="mlp-speculator")


def test_published_medusa_layout(tiny_model, tmp_path):
    """medusa_lm_head.safetensors + config.json, with each head's own LM head, as Medusa saves them."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    heads, layers, hidden, vocab = 3, 2, 32, 64
    raw = {}
    for i in range(heads):
        for j in range(layers):
            raw[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden) * 0.2
            raw[f"{i}.{j}.linear.bias"] = torch.randn(hidden) * 0.1
        raw[f"{i}.{layers}.weight"] = torch.randn(vocab, hidden)
    save_file(raw, tmp_path / "medusa_lm_head.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(
        {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}))
    module, shared, _ = load_heads(tmp_path, _target_info(tiny_model), "medusa")
    x = torch.randn(5, hidden, dtype=torch.float64)
    got = module.logits(module(x), shared)  # [5, heads, vocab]
    for i in range(heads):  # Medusa's own definition, from the raw tensors
        h = x
        for j in range(layers):
            h = h + torch.nn.functional.silu(h @ raw[f"{i}.{j}.linear.weight"].double().T + raw[f"{i}.{j}.linear.bias"].double())
        torch.testing.assert_close(got[:, i], h @ raw[f"{i}.{layers}.weight"].double().T)
    check_drafter("medusa", tiny_model, drafter_options={"heads": str(tmp_path)}, spec_lengths=(3,))

    raw["0.0.linear.weight"] = torch.randn(hidden + 1, hidden + 1)
    save_file(raw, tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(ConfigError, match="hidden states of width 33, but target .* has 32"):
        load_heads(tmp_path, _target_info(tiny_model), "medusa")


def test_published_eagle_layout(tiny_model, tmp_path):
    """config.json + model.safetensors holding fc and layers.0 (and a copy of the embeddings)."""
    from safetensors.torch import save_file

    torch.manual_seed(4)
    ours = build_heads("eagle", tiny_model.config).double()
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.2)
    raw = {"fc.weight": ours.fc.weight, "fc.bias": ours.fc.bias, "embed_tokens.weight": torch.randn(64, 32)}
    raw.update({f"layers.0.{k}": v for k, v in ours.layer.state_dict().items()})
    save_file({k: v.float().contiguous() for k, v in raw.items()}, tmp_path / "model.safetensors")
    cfg = {k: getattr(tiny_model.config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                      "num_key_value_heads", "rms_norm_eps", "vocab_size")}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"],
                                                      "num_hidden_layers": 1, "bias": True}))
    module, _, _ = load_heads(tmp_path, _target_info(tiny_model), "eagle")
    assert isinstance(module, EagleDraft)
    f, e = torch.randn(1, 6, 32, dtype=torch.float64), torch.randn(1, 6, 32, dtype=torch.float64)
    pos = torch.arange(6)[None]
    want = ours.double()(f, e, pos, causal_mask(6, torch.float64, "cpu"))
    got = module(f, e, pos, causal_mask(6, torch.float64, "cpu"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # saved in float32
    check_drafter("eagle", tiny_model, drafter_options={"heads": str(tmp_path)}, spec_lengths=(3,))


def test_medusa_heads_start_as_identity():
    """Zero-initialised blocks: before training every head repeats the target's own next guess."""
    heads = MedusaHeads(8, 3)
    x = torch.randn(2, 8)
    assert torch.equal(heads(x), x[:, None].expand(2, 3, 8))


def _eagle_runner(module):
    """The drafter's inference path for ``module``: its layer on specdraft's block over a KV cache."""
    from specdraft.drafters.api import default_services

    return default_services().layer_runner(module.layer, module.llama_config, compile=False, attention_norm=False)


def _random_eagle(model, seed):
    torch.manual_seed(seed)
    module = build_heads("eagle", model.config).double()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return module


def test_eagle_training_steps_see_what_drafting_sees(tiny_model):
    """The unrolled training pass over true + guessed pairs equals the drafter's cache path,
    chain by chain and step by step."""
    from specdraft.training.batches import eagle_unroll

    module = _random_eagle(tiny_model, 6)
    runner = _eagle_runner(module)
    feats, ids = torch.randn(1, 9, 32, dtype=torch.float64), torch.randint(1, 64, (1, 9))
    embed = tiny_model.get_input_embeddings()
    with torch.no_grad():
        unrolled = eagle_unroll(module, embed, ids, feats, depth=3)
        assert [g.shape[1] for g in unrolled] == [8, 7, 6]
        for t in range(6):
            runner.cache.reset(1, 16)
            guess = runner.forward(module.fc_in(feats[:, : t + 1], embed(ids[:, 1 : t + 2])))[:, -1:]  # true pairs 0..t
            for step in (1, 2, 3):
                torch.testing.assert_close(guess[:, 0], unrolled[step - 1][:, t], rtol=1e-10, atol=1e-10)
                if step < 3:  # then the guessed pair, as the drafter feeds it
                    guess = runner.forward(module.fc_in(guess, embed(ids[:, t + step + 1 : t + step + 2])))


def test_eagle3_training_steps_see_what_drafting_sees(tiny_model):
    """EAGLE-3's training-time test (train-heads unrolls the layer on its own outputs from the
    fused features of three layers) equals the drafter's path: fc over the layers' states side by
    side, then the layer on specdraft's block over a KV cache fed ``[embed(x) ; feature]``, chain
    by chain and step by step; and so do the draft-vocabulary logits read from it."""
    from specdraft.drafters.api import default_services
    from specdraft.training.batches import eagle3_features, eagle_unroll

    torch.manual_seed(8)
    module = build_heads("eagle3", tiny_model.config, aux_layers=[1, 0, 1], draft_vocab_size=40).double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else torch.nn.init.normal_(p, std=0.2)
    runner = default_services().layer_runner(module.midlayer, module.llama_config, compile=False)
    states, ids = torch.randn(1, 9, 3 * 32, dtype=torch.float64), torch.randint(1, 64, (1, 9))
    embed = tiny_model.get_input_embeddings()

    def pairs(features, tokens):  # what Eagle3Drafter.step feeds its runner
        return torch.cat([embed(tokens), features], dim=-1)

    with torch.no_grad():
        unrolled = eagle_unroll(module, embed, ids, eagle3_features(module, states), depth=3)
        assert [g.shape[1] for g in unrolled] == [8, 7, 6]
        for t in range(6):
            runner.cache.reset(1, 16)
            guess = runner.forward(pairs(module.fc(states[:, : t + 1]), ids[:, 1 : t + 2]))[:, -1:]  # true pairs 0..t
            for step in (1, 2, 3):
                torch.testing.assert_close(guess[:, 0], unrolled[step - 1][:, t], rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(module.logits(guess[:, 0]), module.logits(unrolled[step - 1][:, t]),
                                           rtol=1e-10, atol=1e-10)
                if step < 3:  # then the guessed pair, as the drafter feeds it
                    guess = runner.forward(pairs(guess, ids[:, t + step + 1 : t + step + 2]))


@pytest.mark.parametrize("soft", [False, True], ids=["hard", "soft"])
def test_eagle3_loss_weighs_unrolled_steps_and_keeps_to_the_draft_vocabulary(tiny_model, soft):
    """sum over unrolled steps s of 0.8^(s-1) x the mean token loss of step s's guesses, at the
    answer positions whose token is in the draft vocabulary (every 2nd token here): hard, the
    real token's draft index; soft, the target's distribution (from its final-norm state one
    position earlier) over the draft tokens, renormalised. Checked position by position."""
    from specdraft.drafters.heads.modules import SharedHead
    from specdraft.training.batches import eagle3_features, eagle_unroll, padded_batch
    from specdraft.training.heads import EAGLE3_DEPTH, eagle3_loss

    draft = torch.arange(0, 64, 2)  # the draft vocabulary: target ids 0, 2, 4, ...
    torch.manual_seed(9)
    module = build_heads("eagle3", tiny_model.config, draft_vocab_size=len(draft)).double()
    module.d2t.copy_(draft - torch.arange(len(draft)))
    head = SharedHead(tiny_model.lm_head, 64, draft)
    seqs = [{"ids": torch.randint(1, 64, (n,)).tolist(), "prompt_len": 3} for n in (11, 8)]
    states = target_features(tiny_model, seqs, progress=False, dtype=torch.float64,
                             layers=feature_layers("eagle3", module.aux_layers, tiny_model.config.num_hidden_layers))
    ids, feats, valid, answer = padded_batch(seqs, states, torch.float64, "cpu")
    embed = tiny_model.get_input_embeddings()
    with torch.no_grad():
        loss = eagle3_loss(module, head, embed, ids, feats, answer, soft)
        final = feats[..., 3 * 32 :]
        expected = 0
        for s, guess in enumerate(eagle_unroll(module, embed, ids, eagle3_features(module, feats), EAGLE3_DEPTH), 1):
            terms = []
            for b, seq in enumerate(seqs):
                for j in range(guess.shape[1]):
                    p = j + s + 1  # the token chain j guesses at step s
                    if p < len(seq["ids"]) and p >= seq["prompt_len"] and seq["ids"][p] % 2 == 0:
                        logp = module.logits(guess[b, j]).log_softmax(-1)
                        if soft:
                            terms.append(-(tiny_model.lm_head(final[b, p - 1])[draft].softmax(-1) * logp).sum())
                        else:
                            terms.append(-logp[seq["ids"][p] // 2])
            expected = expected + 0.8 ** (s - 1) * torch.stack(terms).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)  # the loss's logits are float32


@pytest.mark.parametrize("batch", [1, 3])
def test_eagle_layer_runner_computes_the_transformers_layer(tiny_model, batch):
    """The drafter's path (fc, then the layer on specdraft's block over the runner's KV cache)
    equals EagleDraft.forward (transformers' layer over the whole sequence, no cache) for ragged
    catch-ups of true pairs and one-token draft steps, round after round with rollbacks; the cache
    then holds what one fresh pass over the true pairs stores."""
    module = _random_eagle(tiny_model, 7)
    embed = tiny_model.get_input_embeddings()
    gen = torch.Generator().manual_seed(7)
    runner = _eagle_runner(module)

    def reference(f, x):  # [n, H] features and [n] next tokens -> the guesses after each pair  # [n, H]
        n = x.shape[0]
        return module(f[None], embed(x[None]), torch.arange(n)[None], causal_mask(n, torch.float64, "cpu"))[0]

    feats = [torch.zeros(0, 32, dtype=torch.float64) for _ in range(batch)]  # true pairs fed, per row
    toks = [torch.zeros(0, dtype=torch.long) for _ in range(batch)]
    runner.cache.reset(batch, 8)
    rounds = ([5, 3, 4], [1, 1, 1], [2, 0, 3], [3, 3, 3])
    with torch.no_grad():
        for counts in (c[:batch] for c in rounds):
            runner.cache.set_lengths([len(t) for t in toks])  # forget last round's guessed pairs
            runner.cache.reserve(max(map(len, toks)) + max(counts) + 3)
            width = max(counts)
            f = torch.randn(batch, width, 32, dtype=torch.float64, generator=gen)
            x = torch.randint(1, 64, (batch, width), generator=gen)
            for b, n in enumerate(counts):
                f[b, n:], x[b, n:] = 0, 0  # padding of shorter rows
                feats[b], toks[b] = torch.cat([feats[b], f[b, :n]]), torch.cat([toks[b], x[b, :n]])
            even = len(set(counts)) == 1
            guess = runner.forward(module.fc_in(f, embed(x)), advance=None if even else counts)
            assert runner.cache.lengths.tolist() == [len(t) for t in toks]
            guess = torch.stack([guess[b, max(n - 1, 0)] for b, n in enumerate(counts)])  # each row's newest
            drafted_f, drafted_x = [t.clone() for t in feats], [t.clone() for t in toks]
            for b, n in enumerate(counts):
                if n:
                    torch.testing.assert_close(guess[b], reference(feats[b], toks[b])[-1], rtol=1e-10, atol=1e-10)
            for _ in range(3):  # draft steps: the guessed feature and a drafted token, one pair per row
                token = torch.randint(1, 64, (batch,), generator=gen)
                for b in range(batch):
                    drafted_f[b] = torch.cat([drafted_f[b], guess[b : b + 1]])
                    drafted_x[b] = torch.cat([drafted_x[b], token[b : b + 1]])
                guess = runner.forward(module.fc_in(guess[:, None], embed(token[:, None])))[:, 0]
                for b in range(batch):
                    if counts[b]:
                        torch.testing.assert_close(guess[b], reference(drafted_f[b], drafted_x[b])[-1],
                                                   rtol=1e-10, atol=1e-10)
        runner.cache.set_lengths([len(t) for t in toks])
        fresh = _eagle_runner(module)
        fresh.cache.reset(batch, 64)
        width = max(map(len, toks))
        f, x = torch.zeros(batch, width, 32, dtype=torch.float64), torch.zeros(batch, width, dtype=torch.long)
        for b in range(batch):
            f[b, : len(toks[b])], x[b, : len(toks[b])] = feats[b], toks[b]
        fresh.forward(module.fc_in(f, embed(x)), advance=[len(t) for t in toks])
    assert torch.equal(fresh.cache.lengths, runner.cache.lengths)
    ours, theirs = runner.cache.kv, fresh.cache.kv
    for mine, ref in zip(ours.keys + ours.values, theirs.keys + theirs.values):
        for b, t in enumerate(toks):
            torch.testing.assert_close(mine[b, :, : len(t)], ref[b, :, : len(t)], rtol=1e-10, atol=1e-10)


def test_eagle_drafts_through_the_layer_runner(tiny_model, tmp_path, monkeypatch):
    """Every draft pass runs the layer runner (the transformers layer only serves training), and
    greedy output over ragged prompts equals plain decoding."""
    from specdraft.runner.layers import LayerRunner

    calls = []
    original = LayerRunner.forward
    monkeypatch.setattr(LayerRunner, "forward", lambda self, x, **kw: calls.append(x.shape) or original(self, x, **kw))
    layer_calls = []
    heads = random_heads("eagle", tiny_model, tmp_path / "eagle", seed=1)
    dec = SpeculativeDecoder(tiny_model, None, drafter="eagle", spec_length=4, adaptive=False,
                             drafter_options={"heads": str(heads), "min_confidence": 0})
    assert isinstance(dec.drafter.runner, LayerRunner)
    dec.drafter.module.layer.register_forward_hook(lambda *a: layer_calls.append(1))
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3]]
    results = dec.generate_ids(prompts, max_new_tokens=12)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(tiny_model, p, 12)
    assert any(s[1] == 1 for s in calls) and any(s[1] > 1 for s in calls)  # draft steps and catch-ups
    assert not layer_calls


def test_layer_runner_names_what_it_cannot_run(tiny_model):
    from specdraft.drafters.api import default_services

    module = build_heads("eagle", tiny_model.config)
    with pytest.raises(ConfigError, match="pass attention_norm=False"):
        default_services().layer_runner(module.layer, module.llama_config, compile=False)  # EAGLE-1's layer has no input norm


@pytest.mark.parametrize("kind", ["eagle", "mlp-speculator"])
def test_heads_draft_on_the_product_the_services_lend(tiny_model, tmp_path, monkeypatch, kind):
    """The shared LM head's rows run on ``services.fast_linear``'s product when it lends one (a
    class attribute once hid the assigned module, so drafting ran ``F.linear`` instead), and the
    output stays plain decoding's."""
    from specdraft.services import DrafterServices

    calls = []

    class Recording(torch.nn.Linear):
        def forward(self, x):
            calls.append(x.shape)
            return super().forward(x)

    def lend(self, weight, bias=None, quantize=None):
        linear = Recording(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
        linear.weight.data.copy_(weight)
        if bias is not None:
            linear.bias.data.copy_(bias)
        return linear

    monkeypatch.setattr(DrafterServices, "fast_linear", lend)
    heads = random_heads(kind, tiny_model, tmp_path / kind, seed=1)
    dec = SpeculativeDecoder(tiny_model, None, drafter=kind, spec_length=3, adaptive=False,
                             drafter_options={"heads": str(heads), "min_confidence": 0})
    assert isinstance(dec.drafter.head.product, Recording)
    prompts = [[1, 2, 3, 4, 5], [9, 10, 11, 12]]
    for p, r in zip(prompts, dec.generate_ids(prompts, max_new_tokens=8)):
        assert r.token_ids == plain_greedy(tiny_model, p, 8)
    assert calls
