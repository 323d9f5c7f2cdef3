"""End to end on the real default model."""

from __future__ import annotations

import pytest
import torch

from specdraft import ConfigError, SpeculativeDecoder
from specdraft.models import cache_dir, resolve_target

pytestmark = pytest.mark.e2e
NEW = 40


@pytest.fixture(scope="module")
def plain_outputs(default_f64, prompts):
    model, tok = default_f64
    with SpeculativeDecoder(model, tok, drafter="none") as dec:
        return {cat: dec.generate(p, max_new_tokens=NEW)[0] for cat, p in prompts.items()}


def test_plain_engine_equals_transformers_generate(default_f64, plain_outputs, prompts):
    model, tok = default_f64
    dec = SpeculativeDecoder(model, tok, drafter="none")
    for cat, prompt in prompts.items():
        ids = dec.encode(prompt)
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=tok.eos_token_id)
        assert plain_outputs[cat].token_ids == out[0, len(ids):].tolist(), cat


@pytest.mark.parametrize("drafter", ["ngram", "prompt-lookup"])
def test_greedy_parity_on_real_prompts(default_f64, plain_outputs, prompts, drafter, step_clock):
    """float64, the adaptive draft length (its lengths chosen from equal pass costs, ``step_clock``,
    so it drafts whatever this machine's timings; a fixed K on real prompts is
    test_greedy_parity_in_bfloat16's, in the CPU's default dtype)."""
    model, tok = default_f64
    dec = SpeculativeDecoder(model, tok, drafter=drafter, spec_length=4)
    results = dec.generate(list(prompts.values()), max_new_tokens=NEW)  # batched, different lengths
    for (cat, _), r in zip(prompts.items(), results):
        assert r.token_ids == plain_outputs[cat].token_ids, cat
        assert r.text == plain_outputs[cat].text
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_predictions_right_wrong_and_absent_leave_the_output_alone(default_f64, plain_outputs, prompts, step_clock):
    """Predicted Outputs on the real model in float64: each prompt with its own plain output as
    the prediction, an edited one (words swapped and dropped), or none, in one batch
    (``step_clock``: draft lengths chosen from equal pass costs, not from this machine's timings)."""
    model, tok = default_f64
    cats = list(prompts)
    predictions = []
    for i, cat in enumerate(cats):
        words = plain_outputs[cat].text.split(" ")
        edited = " ".join(words[:3] + ["indeed"] + words[5:])
        predictions.append([plain_outputs[cat].text, edited, None][i % 3])
    dec = SpeculativeDecoder(model, tok, drafter="ngram", spec_length=4)
    results = dec.generate([prompts[c] for c in cats], max_new_tokens=NEW, prediction=predictions)
    for cat, r in zip(cats, results):
        assert r.token_ids == plain_outputs[cat].token_ids, cat
    right = results[0].stats
    assert right.accepted_prediction_tokens > NEW // 2 and right.tokens_per_pass > 3


def test_stop_string_cuts_text_like_plain(default_f32, prompts):
    model, tok = default_f32
    prompt = prompts["qa"]
    plain = SpeculativeDecoder(model, tok, drafter="none").generate(prompt, max_new_tokens=60)[0]
    assert "." in plain.text
    r = SpeculativeDecoder(model, tok, drafter="ngram").generate(prompt, max_new_tokens=60, stop=".")[0]
    assert r.finish_reason == "stop"
    assert r.text == plain.text[: plain.text.index(".")]
    assert r.token_ids == plain.token_ids[: len(r.token_ids)]


def test_prompt_longer_than_context(default_f32):
    model, tok = default_f32
    dec = SpeculativeDecoder(model, tok, drafter="ngram")
    with pytest.raises(ConfigError, match="context holds 8192; shorten it"):
        dec.generate("word " * 9000, max_new_tokens=4, raw=True)


def test_empty_prompt(default_f32):
    model, tok = default_f32
    with pytest.raises(ConfigError, match="prompt 0 is empty"):
        SpeculativeDecoder(model, tok).generate("   ")


def test_chat_template_and_raw(default_f32):
    model, tok = default_f32
    dec = SpeculativeDecoder(model, tok)
    templated, raw = dec.encode("Hi"), dec.encode("Hi", raw=True)
    assert tok.decode(templated).endswith("<|im_start|>assistant\n")
    assert tok.decode(raw) == "Hi"


def test_gguf_is_converted_once_to_safetensors():
    name, path = resolve_target(None)
    assert name == "SmolLM2-135M-Instruct"
    assert path.startswith(str(cache_dir()))
    import json
    from pathlib import Path

    folder = Path(path)
    assert (folder / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("kind", ["draft-model", "medusa", "eagle", "eagle3", "mlp-speculator"])
def test_shipped_drafters_are_exact_out_of_the_box(default_f64, plain_outputs, prompts, kind):
    model, tok = default_f64
    dec = SpeculativeDecoder(model, tok, drafter=kind, spec_length=3, adaptive=False)
    if kind == "draft-model":  # the shipped draft or heads, found by fingerprint
        assert dec.drafter.draft_name == "SmolLM2-135M-Instruct-draft-2L"
    else:
        assert dec.drafter.meta["kind"] == kind and dec.drafter.meta["target"] == "SmolLM2-135M-Instruct"
    results = dec.generate(list(prompts.values()), max_new_tokens=NEW)
    for (cat, _), r in zip(prompts.items(), results):
        assert r.token_ids == plain_outputs[cat].token_ids, cat
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert 0.03 * sum(r.stats.drafted_tokens for r in results) < accepted  # trained heads (random ones: ~0 of 49k)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "draft-model"])
def test_shipped_drafters_with_trees_are_exact(default_f64, plain_outputs, prompts, kind):
    """Trees of 8 nodes (fixed budget) on the real model: the same text as plain decoding."""
    model, tok = default_f64
    dec = SpeculativeDecoder(model, tok, drafter=kind, spec_length=3, adaptive=False,
                             drafter_options={"tree_budget": 8, "tree_width": 2, "min_confidence": 0.0})
    results = dec.generate(list(prompts.values()), max_new_tokens=NEW)
    for (cat, _), r in zip(prompts.items(), results):
        assert r.token_ids == plain_outputs[cat].token_ids, cat
    stats = [r.stats for r in results]
    assert sum(s.drafted_tokens for s in stats) > sum(sum(s.drafted_per_position) for s in stats)  # branches
    assert sum(s.accepted_tokens for s in stats) > 0


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model", "eagle"])
def test_sampling_through_the_drafters_probabilities_equals_plain_greedy_at_top_k_1(default_f64, plain_outputs,
                                                                                     prompts, drafter):
    """Seeded sampling on the real model runs rejection sampling against the drafter's probabilities;
    with top_k=1 the target's distribution is one-hot, so the output must be plain greedy decoding's
    (seeded reproducibility itself is tested on the tiny model in tests/engine)."""
    model, tok = default_f64
    dec = SpeculativeDecoder(model, tok, drafter=drafter, spec_length=3, adaptive=False)
    r = dec.generate(prompts["qa"], max_new_tokens=NEW, temperature=0.7, top_k=1, seed=5)[0]
    assert r.token_ids == plain_outputs["qa"].token_ids
    assert r.stats.accepted_tokens > 0


def test_shipped_weights_are_found_in_every_precision(default_f32, prompts):
    """A GPU loads the default target in bfloat16: the shipped drafters must still find their weights.
    A bfloat16 copy of the loaded float32 model has the weights load_target(dtype="bfloat16") gives."""
    import copy

    model, tok = copy.deepcopy(default_f32[0]).to(torch.bfloat16), default_f32[1]
    assert model.dtype == torch.bfloat16
    for kind in ("draft-model", "medusa", "eagle", "eagle3", "mlp-speculator"):
        dec = SpeculativeDecoder(model, tok, drafter=kind, spec_length=2)
        assert dec.generate(prompts["qa"], max_new_tokens=4)[0].stats.target_passes > 0, kind


@pytest.fixture(scope="module")
def plain_bf16(default_bf16, eight_prompts):
    model, tok = default_bf16
    with SpeculativeDecoder(model, tok, drafter="none") as dec:
        return dec.generate(list(eight_prompts.values()), max_new_tokens=NEW)


@pytest.mark.parametrize("drafter, options", [
    ("ngram", None), ("prompt-lookup", None), ("draft-model", None), ("medusa", None), ("eagle", None),
    ("mlp-speculator", None), ("eagle", {"tree_budget": 8, "tree_width": 2, "min_confidence": 0.0}),
    ("suffix", None), ("eagle3", None), ("eagle3", {"tree_budget": 8, "tree_width": 2, "min_confidence": 0.0}),
], ids=["ngram", "prompt-lookup", "draft-model", "medusa", "eagle", "mlp-speculator", "eagle-tree", "suffix", "eagle3",
        "eagle3-tree"])
def test_greedy_parity_in_bfloat16(default_bf16, plain_bf16, eight_prompts, drafter, options):
    """bfloat16, the CPU default where the processor has native bfloat16 products: every built-in
    drafter (the shipped draft model and heads included) gives plain decoding's tokens on eight real
    prompts in one batch. Before the row-invariant kernels, 9 of 13 Spec-Bench outputs differed."""
    model, tok = default_bf16
    with SpeculativeDecoder(model, tok, drafter=drafter, spec_length=4, adaptive=False, drafter_options=options) as dec:
        assert dec.runner.dtype == model.dtype == torch.bfloat16
        results = dec.generate(list(eight_prompts.values()), max_new_tokens=NEW)
    for cat, plain, r in zip(eight_prompts, plain_bf16, results, strict=True):
        assert r.token_ids == plain.token_ids, cat
    assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.fixture(scope="module")
def plain_gguf(default_bf16, eight_prompts):
    model, tok = default_bf16
    with SpeculativeDecoder(model, tok, drafter="none", quantize="gguf") as dec:
        assert dec.runner_info["kernels"]["gguf_blocks"] == "121 of 121 layers (Q4_1, Q8_0)"
        return dec.generate(list(eight_prompts.values()), max_new_tokens=NEW)


@pytest.mark.parametrize("drafter, options", [
    ("ngram", None), ("eagle", {"tree_budget": 8, "tree_width": 2, "min_confidence": 0.0}),
], ids=["ngram", "eagle-tree"])
def test_greedy_parity_on_the_files_own_blocks(default_bf16, plain_gguf, eight_prompts, drafter, options):
    """quantize="gguf": the default model's Q4_1 and Q8_0 blocks as they are (no float weights): the
    drafters give plain decoding's tokens of that model, on eight real prompts in one batch."""
    model, tok = default_bf16
    with SpeculativeDecoder(model, tok, drafter=drafter, spec_length=4, adaptive=False, drafter_options=options,
                            quantize="gguf") as dec:
        results = dec.generate(list(eight_prompts.values()), max_new_tokens=NEW)
    for cat, plain, r in zip(eight_prompts, plain_gguf, results, strict=True):
        assert r.token_ids == plain.token_ids, cat
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_greedy_parity_with_predictions_in_bfloat16(default_bf16, plain_bf16, eight_prompts, step_clock):
    """Predicted drafts are the widest passes (up to 33 tokens): in bfloat16 too they give plain
    decoding's tokens, with the right output, an edited one or none as the prediction."""
    model, tok = default_bf16
    predictions = []
    for i, plain in enumerate(plain_bf16):
        words = plain.text.split(" ")
        predictions.append([plain.text, " ".join(words[:4] + ["quite"] + words[6:]), None][i % 3])
    with SpeculativeDecoder(model, tok, drafter="ngram", spec_length=4) as dec:
        results = dec.generate(list(eight_prompts.values()), max_new_tokens=NEW, prediction=predictions)
    for cat, plain, r in zip(eight_prompts, plain_bf16, results, strict=True):
        assert r.token_ids == plain.token_ids, cat
    assert results[0].stats.accepted_prediction_tokens > NEW // 2


def test_min_tokens_and_stop_token_ids_in_bfloat16(default_bf16, eight_prompts):
    """min_tokens masks EOS and the stop tokens in the target's distribution before acceptance: in
    bfloat16 a drafter still gives plain decoding's tokens under the same settings ("." stops the
    answer, but not within its first NEW // 2 tokens)."""
    model, tok = default_bf16
    settings = dict(max_new_tokens=NEW, min_tokens=NEW // 2, stop_token_ids=tok.encode(".", add_special_tokens=False))
    with SpeculativeDecoder(model, tok, drafter="none") as dec:
        plain = dec.generate(list(eight_prompts.values()), **settings)
    with SpeculativeDecoder(model, tok, drafter="ngram", spec_length=4, adaptive=False) as dec:
        results = dec.generate(list(eight_prompts.values()), **settings)
    for cat, p, r in zip(eight_prompts, plain, results, strict=True):
        assert r.token_ids == p.token_ids, cat
    assert any(p.finish_reason == "stop" for p in plain)  # the stop token did end some answers
    assert all(len(p.token_ids) >= NEW // 2 for p in plain)
