"""Heads as other projects publish them: each layout built small, with config keys and weight names
exactly as published (random weights), loaded, checked against the raw tensors and decoded exactly;
and each layout specdraft refuses, refused in one line naming what differs.

Layouts (see ``specdraft.drafters.heads.published``): EAGLE-3 as the EAGLE repository saves it
(``yuhuili/EAGLE3-*``: ``midlayer.*``, ``d2t``, ``t2d``, ``pytorch_model.bin``), the same without a
draft vocabulary (``model.safetensors``, ModelOpt's ``eagle_config``), the ``speculators`` format
(vLLM / Red Hat) for EAGLE-3 and EAGLE, and HASS (EAGLE-1's layout with an ``fc.bias``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specdraft import ConfigError, SpeculativeDecoder
from specdraft.drafters.heads.formats import load_heads
from specdraft.drafters.heads.modules import Eagle3Draft, EagleDraft, causal_mask
from specdraft.testing import plain_greedy, repetitive_prompts, tiny_llama

H, VOCAB, HEADS, KV_HEADS, FFN = 32, 64, 4, 2, 64
HEAD_DIM = H // HEADS
#: the draft vocabulary of the EAGLE-3 heads that have one: 40 of the target's 64 tokens, not a prefix
DRAFT_IDS = torch.cat([torch.arange(0, 48, 2), torch.arange(48, 64)])
#: the one-layer Llama config a published head carries (its own eps and rope: not the target's)
LAYER = {"hidden_act": "silu", "hidden_size": H, "intermediate_size": FFN, "num_attention_heads": HEADS,
         "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-05, "vocab_size": VOCAB}
SPECULATORS_CONFIG = {"algorithm": "eagle3", "default_proposal_method": "greedy",
                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                            "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                      "verifier": {"name_or_path": "tiny/target", "architectures": ["LlamaForCausalLM"]}}
MAX_NEW = 12


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=4, seed=6)


@pytest.fixture(scope="module")
def info(target):
    return SpeculativeDecoder(target, None, drafter="none").target


# -- building published folders -----------------------------------------------------------------

def _linear(gen, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=gen) * (1.5 / cols ** 0.5)


def _norm(gen, n: int = H) -> torch.Tensor:
    return torch.rand(n, generator=gen) + 0.5


def _decoder_layer(gen, attn_in: int = H, input_norm: bool = True, hidden_norm: bool = False) -> dict:
    """A Llama decoder layer's weights under transformers' names (q/k/v reading ``attn_in``)."""
    layer = {"self_attn.q_proj.weight": _linear(gen, HEADS * HEAD_DIM, attn_in),
             "self_attn.k_proj.weight": _linear(gen, KV_HEADS * HEAD_DIM, attn_in),
             "self_attn.v_proj.weight": _linear(gen, KV_HEADS * HEAD_DIM, attn_in),
             "self_attn.o_proj.weight": _linear(gen, H, HEADS * HEAD_DIM),
             "mlp.gate_proj.weight": _linear(gen, FFN, H), "mlp.up_proj.weight": _linear(gen, FFN, H),
             "mlp.down_proj.weight": _linear(gen, H, FFN), "post_attention_layernorm.weight": _norm(gen)}
    if input_norm:
        layer["input_layernorm.weight"] = _norm(gen)
    if hidden_norm:
        layer["hidden_norm.weight"] = _norm(gen)
    return layer


def eagle3_weights(seed: int, layer_prefix: str = "midlayer.", draft_ids=DRAFT_IDS, aux: int = 3) -> dict:
    """An EAGLE-3 head's tensors as the EAGLE repository names them (``layer_prefix`` ``layers.0.``:
    speculators'); ``draft_ids`` None: no d2t / t2d (a full-vocabulary head)."""
    gen = torch.Generator().manual_seed(seed)
    raw = {layer_prefix + k: v for k, v in _decoder_layer(gen, attn_in=2 * H, hidden_norm=True).items()}
    raw["fc.weight"] = _linear(gen, H, aux * H)
    raw["norm.weight"] = _norm(gen)
    raw["lm_head.weight"] = _linear(gen, VOCAB if draft_ids is None else len(draft_ids), H) * 3
    raw["embed_tokens.weight"] = torch.randn(VOCAB, H, generator=gen)  # a copy of the base model's: ignored
    if draft_ids is not None:
        raw["d2t"] = draft_ids - torch.arange(len(draft_ids))
        raw["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, draft_ids, True)
    return raw


def eagle_weights(seed: int, fc: str = "fc", layer_prefix: str = "layers.0.") -> dict:
    """EAGLE-1's tensors (HASS's with ``fc.bias``); speculators': ``fusion_fc`` and ``transformer.``."""
    gen = torch.Generator().manual_seed(seed)
    raw = {layer_prefix + k: v for k, v in _decoder_layer(gen, input_norm=False).items()}
    raw[f"{fc}.weight"] = _linear(gen, H, 2 * H)
    raw[f"{fc}.bias"] = torch.randn(H, generator=gen) * 0.1
    return raw


def write(folder, config: dict | None, raw: dict, file: str = "model.safetensors", dtype=torch.float32):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in raw.items()}
    if file.endswith(".safetensors"):
        save_file(tensors, folder / file)
    else:
        torch.save(tensors, folder / file)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_sharded(folder, config: dict, raw: dict):
    """Two safetensors shards and their ``model.safetensors.index.json``, as ``save_pretrained`` splits."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(raw)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: raw[k].contiguous() for k in keys}, folder / file)
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def yuhuili_config(**extra) -> dict:
    """The EAGLE repository's EAGLE-3 config.json (eagle/traineagle3/config.json), shrunk."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2, **LAYER,
            "initializer_range": 0.02, "max_position_embeddings": 2048, "model_type": "llama",
            "num_hidden_layers": 1, "pad_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "float16",
            "transformers_version": "4.28.1", "use_cache": True, "draft_vocab_size": len(DRAFT_IDS), **extra}


def speculators_config(kind: str, **extra) -> dict:
    """speculators' config.json: its fields, a transformer_layer_config from ``to_diff_dict``."""
    layer = {**LAYER, "model_type": "llama", "num_hidden_layers": 1, "rope_theta": 20000.0,
             "max_position_embeddings": 2048, "architectures": ["LlamaForCausalLM"]}
    config = {"speculators_model_type": kind, "speculators_version": "0.1.0.dev", "transformer_layer_config": layer,
              "speculators_config": {**SPECULATORS_CONFIG, "algorithm": kind}}
    if kind == "eagle3":
        config.update(architectures=["Eagle3Speculator"], draft_vocab_size=VOCAB, norm_before_residual=True,
                      target_hidden_size=None, eagle_aux_hidden_state_layer_ids=[0, 1, 3])
    else:
        config.update(architectures=["EagleSpeculator", "LlamaDecoderLayer"],
                      transformer_layer_architecture="LlamaDecoderLayer", layernorms=False, fusion_bias=True)
    return {**config, **extra}


def hass_config(**extra) -> dict:
    """HASS's config.json (train/EAGLE-LLaMA3-Instruct-8B), shrunk; its fc has a bias."""
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, **LAYER,
            "initializer_range": 0.02, "max_position_embeddings": 2048, "model_type": "llama",
            "num_hidden_layers": 1, "pad_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "float16",
            "transformers_version": "4.28.1", "use_cache": True, "rope_theta": 500000.0, "bias": True, **extra}


#: name -> (drafter, builder(folder) -> folder, the target layers its fc reads or None)
LAYOUTS = {
    # the EAGLE repository: pytorch_model.bin in float16, no layer ids (vLLM's defaults for 4 layers)
    "eagle3": ("eagle3", lambda p: write(p, yuhuili_config(), eagle3_weights(1), "pytorch_model.bin", torch.float16),
               (1, 2, 2)),
    # full vocabulary (no d2t / t2d / draft_vocab_size), ModelOpt's eagle_config naming layers out of
    # order, weights in two shards
    "eagle3-full-vocabulary": ("eagle3", lambda p: write_sharded(p, {k: v for k, v in yuhuili_config(eagle_config={
        "eagle_aux_hidden_state_layer_ids": [3, 0, 2], "use_aux_hidden_state": True,
        "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True, "use_mtp_layernorm": False}).items()
        if k != "draft_vocab_size"}, eagle3_weights(2, draft_ids=None)), (0, 2, 3)),
    "speculators-eagle3": ("eagle3", lambda p: write(p, speculators_config("eagle3", draft_vocab_size=len(DRAFT_IDS)),
                                                     eagle3_weights(3, "layers.0."), dtype=torch.bfloat16), (0, 1, 3)),
    "speculators-eagle": ("eagle", lambda p: write(p, speculators_config("eagle"),
                                                   eagle_weights(4, "fusion_fc", "transformer.")), None),
    "hass": ("eagle", lambda p: write(p, hass_config(), {**eagle_weights(5),
                                                         "embed_tokens.weight": torch.randn(VOCAB, H)}), None),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    return {name: str(build(root / name)) for name, (_, build, _) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def expected(target):
    prompts = repetitive_prompts(VOCAB, seed=3)
    return prompts, [plain_greedy(target, p, MAX_NEW) for p in prompts]


# -- loaded as the weights say ------------------------------------------------------------------

def _rms(x, w, eps=1e-5):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, theta):  # x [n, heads, d] at positions 0..n-1
    inv = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., HEAD_DIM // 2:], x[..., : HEAD_DIM // 2]], -1) * sin


def eagle3_reference(raw: dict, prefix: str, states, embeds, theta: float, norm_before_residual: bool):
    """EAGLE-3's draft-vocabulary logits written out from the raw tensors (the EAGLE repository's
    ``Model.forward`` with ``LlamaDecoderLayeremb``, then ``lm_head(norm(.))``).  # [n, draft_vocab]"""
    w = {k: v.double() for k, v in raw.items() if v.is_floating_point()}
    layer = {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
    n = states.shape[0]
    g = states @ w["fc.weight"].T  # [n, H]
    normed = _rms(g, layer["hidden_norm.weight"])
    x = torch.cat([_rms(embeds, layer["input_layernorm.weight"]), normed], -1)  # [n, 2H]
    q = _rope((x @ layer["self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), theta)
    k = _rope((x @ layer["self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), theta)
    v = (x @ layer["self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, H) @ layer["self_attn.o_proj.weight"].T
    h = (normed if norm_before_residual else g) + attended
    m = _rms(h, layer["post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ layer["mlp.gate_proj.weight"].T) * (m @ layer["mlp.up_proj.weight"].T))
    out = h + mlp @ layer["mlp.down_proj.weight"].T
    return _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("layout, prefix, theta, before", [("eagle3", "midlayer.", 10000.0, False),
                                                           ("speculators-eagle3", "layers.0.", 20000.0, True)])
def test_eagle3_layouts_compute_what_their_weights_say(info, folders, layout, prefix, theta, before):
    """Logits of the loaded head equal EAGLE-3 written out from the raw tensors: the head's own rope
    (the config's, or transformers' default; never the target's) and norm_before_residual, its draft
    vocabulary mapped through d2t."""
    from specdraft.drafters.heads.published import read_weights

    module, shared, meta = load_heads(folders[layout], info, "eagle3")
    raw = read_weights(Path(folders[layout]))
    assert isinstance(module, Eagle3Draft) and module.aux_layers == LAYOUTS[layout][2]
    assert shared.head_ids.tolist() == DRAFT_IDS.tolist()
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(7, 3 * H, generator=gen, dtype=torch.float64)
    embeds = torch.randn(7, H, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        out = module(module.fc(states)[None], embeds[None], torch.arange(7)[None], causal_mask(7, torch.float64, "cpu"))
        got, full = module.logits(out)[0], shared(out)[0]
    want = eagle3_reference(raw, prefix, states, embeds, theta, before)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # transformers' norms round through float32
    torch.testing.assert_close(full[:, DRAFT_IDS], got)
    outside = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, DRAFT_IDS, False)
    assert bool((full[:, outside] < -1e300).all())  # never drafted
    assert meta["format"] == ("eagle3" if layout == "eagle3" else "speculators")


def test_eagle_layouts_hold_the_published_tensors(info, folders):
    """speculators' EAGLE and HASS: fc (with its bias) and the layer are the published tensors, and the
    draft layer's rope is the checkpoint's own (HASS: 500000)."""
    from specdraft.drafters.heads.published import read_weights

    for layout, fc, prefix, theta in [("speculators-eagle", "fusion_fc", "transformer.", 20000.0),
                                      ("hass", "fc", "layers.0.", 500000.0)]:
        module, _, meta = load_heads(folders[layout], info, "eagle")
        raw = read_weights(Path(folders[layout]))
        assert isinstance(module, EagleDraft)
        assert torch.equal(module.fc.weight, raw[f"{fc}.weight"].double())
        assert torch.equal(module.fc.bias, raw[f"{fc}.bias"].double())
        layer = module.layer.state_dict()
        assert {k for k in layer} == {k[len(prefix):] for k in raw if k.startswith(prefix)}
        assert all(torch.equal(layer[k[len(prefix):]], v.double()) for k, v in raw.items() if k.startswith(prefix))
        assert module.llama_config.rope_parameters["rope_theta"] == theta
        assert meta["target"] == ("tiny/target" if layout == "speculators-eagle" else "")


@pytest.mark.parametrize("file", ["model.safetensors", "pytorch_model.bin"])
def test_eagle3_weights_are_recognised_when_the_config_does_not_say(info, tmp_path, file):
    """A config with no EAGLE-3 key (the EAGLE repository's training config names LlamaForCausalLM):
    the ``midlayer.*`` weights tell, read without loading from safetensors, on loading from a .bin."""
    config = {k: v for k, v in yuhuili_config(architectures=["LlamaForCausalLM"]).items() if k != "draft_vocab_size"}
    write(tmp_path, config, eagle3_weights(11), file)
    module, shared, meta = load_heads(tmp_path, info, "eagle3")
    assert isinstance(module, Eagle3Draft) and shared.head_ids.tolist() == DRAFT_IDS.tolist()
    with pytest.raises(ConfigError, match="holds eagle3 heads, not eagle; use --drafter eagle3"):
        load_heads(tmp_path, info, "eagle")


def test_a_full_vocabulary_head_without_lm_head_uses_the_targets(target, info, tmp_path):
    config = {k: v for k, v in yuhuili_config().items() if k != "draft_vocab_size"}
    write(tmp_path, config, {k: v for k, v in eagle3_weights(12, draft_ids=None).items() if k != "lm_head.weight"})
    module, shared, _ = load_heads(tmp_path, info, "eagle3")
    assert torch.equal(module.lm_head.weight, target.lm_head.weight)
    assert shared.head_ids.tolist() == list(range(VOCAB))


# -- decoded exactly ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["k1", "k3", "tree"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_published_heads_decode_exactly(target, folders, expected, layout, mode):
    """Greedy output equals plain decoding, chains (K 1 and 3) and EAGLE-2 trees, on a ragged batch;
    the heads do draft (min_confidence 0), so rejected and accepted drafts both pass the verifier."""
    drafter, _, aux = LAYOUTS[layout]
    options = {"heads": folders[layout], "min_confidence": 0.0}
    if mode == "tree":
        options["tree_budget"] = 6
    dec = SpeculativeDecoder(target, None, drafter=drafter, spec_length=1 if mode == "k1" else 3, adaptive=False,
                             drafter_options=options)
    if aux is not None:
        assert dec.engine.drafter.hidden_layers == aux  # fc reads these layers, in layer order
    prompts, want = expected
    results = dec.generate_ids(prompts, max_new_tokens=MAX_NEW)
    assert [r.token_ids for r in results] == want
    assert sum(r.stats.drafted_tokens for r in results) > 0


# -- refused in one line ---------------------------------------------------------------------------

def _eagle3_folder(p, config_extra=None, raw_extra=None, drop=(), **weights):
    raw = {k: v for k, v in {**eagle3_weights(7, **weights), **(raw_extra or {})}.items() if k not in drop}
    return write(p, yuhuili_config(**(config_extra or {})), raw)


REFUSED = {
    "not heads": ("eagle3", lambda p: (p.mkdir(), (p / "notes.txt").write_text("hi")),
                  r"holds no heads specdraft can read"),
    "a training state": ("eagle", lambda p: write(p, None, eagle_weights(8)),
                         r"has weights but no config\.json \(an accelerate training state"),
    "another kind": ("eagle", lambda p: _eagle3_folder(p), r"holds eagle3 heads, not eagle; use --drafter eagle3"),
    "another hidden size": ("eagle3", lambda p: _eagle3_folder(p, {"hidden_size": 48, "target_hidden_size": 32}),
                            r"embed tokens of width 48, but target .* has 32"),
    "other target states": ("eagle3", lambda p: _eagle3_folder(p, {"target_hidden_size": 40}),
                            r"read target states of width 40, but target .* has 32"),
    "another vocabulary": ("eagle3", lambda p: _eagle3_folder(p, {"vocab_size": 128256}),
                           r"vocabulary of 128256 tokens \(config\.json vocab_size\)"),
    "layers beyond the target's": ("eagle3",
                                   lambda p: _eagle3_folder(p, {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}),
                                   r"read target layers \[0, 1, 9\], but target .* has 4 layers"),
    "fc for other layers": ("eagle3", lambda p: _eagle3_folder(p, {"eagle_aux_hidden_state_layer_ids": [0, 1]}),
                            r"fc\.weight .* reads 96 values, but 2 target layers \[0, 1\] of width 32 give 64"),
    "d2t outside the vocabulary": ("eagle3", lambda p: _eagle3_folder(p, raw_extra={"d2t": DRAFT_IDS * 0 + 70}),
                                   r"map their draft vocabulary to target ids up to 109"),
    "two EAGLE-3 layers": ("eagle3", lambda p: _eagle3_folder(p, {"num_hidden_layers": 2}),
                           r"EAGLE-3 head in .* has 2 decoder layers"),
    "an fc bias": ("eagle3", lambda p: _eagle3_folder(p, {"bias": True}, {"fc.bias": torch.zeros(H)}),
                   r"has an fc bias"),
    "no LM head": ("eagle3", lambda p: _eagle3_folder(p, drop=("lm_head.weight",)),
                   r"has no lm_head\.weight, and its draft vocabulary \(40 tokens\)"),
    "no aux states": ("eagle3", lambda p: _eagle3_folder(p, {"eagle_config": {"use_aux_hidden_state": False}}),
                      r"eagle_config\.use_aux_hidden_state=false"),
    "two EAGLE layers": ("eagle", lambda p: write(p, hass_config(), {
        **eagle_weights(9), **{k.replace("layers.0.", "layers.1."): v for k, v in eagle_weights(10).items()
                               if k.startswith("layers.0.")}}), r"EAGLE head in .* has 2 decoder layers"),
    "extra norms": ("eagle", lambda p: write(p, hass_config(), {**eagle_weights(9),
                                                                "embed_layernorm.weight": torch.ones(H),
                                                                "hidden_layernorm.weight": torch.ones(H)}),
                    r"extra norms \(embed_layernorm\.weight, hidden_layernorm\.weight"),
    "speculators layernorms": ("eagle", lambda p: write(p, speculators_config("eagle", layernorms=True),
                                                        eagle_weights(4, "fusion_fc", "transformer.")),
                               r"sets layernorms=true"),
    "speculators dflash": ("eagle3", lambda p: write(p, speculators_config("eagle3", speculators_model_type="dflash"),
                                                     eagle3_weights(3, "layers.0.")),
                           r"speculators model of type 'dflash'; specdraft loads 'eagle3' and 'eagle'"),
    "speculators qwen3 layer": ("eagle3", lambda p: write(p, speculators_config("eagle3", transformer_layer_config={
        **LAYER, "model_type": "qwen3"}), eagle3_weights(3, "layers.0.")), r"has a 'qwen3' layer"),
    "speculators norm_before_fc": ("eagle3", lambda p: write(p, speculators_config("eagle3", norm_before_fc=True),
                                                             eagle3_weights(3, "layers.0.")), r"norm_before_fc"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_layouts_say_what_differs_in_one_line(info, tmp_path, case):
    kind, build, line = REFUSED[case]
    build(tmp_path / "heads")
    with pytest.raises(ConfigError, match=line) as caught:
        load_heads(tmp_path / "heads", info, kind)
    assert "\n" not in str(caught.value)


# -- hub ids ---------------------------------------------------------------------------------------

@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline (as every test is: see conftest)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_hub_id_loads_from_the_cache_offline(target, hub_cache, expected):
    """``heads=owner/name`` resolves as a target's hub id does: here, offline, to the cached snapshot."""
    snapshot = hub_cache / "models--someone--EAGLE3-tiny" / "snapshots" / "0123abcd"
    write(snapshot, speculators_config("eagle3", draft_vocab_size=len(DRAFT_IDS)), eagle3_weights(3, "layers.0."))
    (hub_cache / "models--someone--EAGLE3-tiny" / "refs").mkdir()
    (hub_cache / "models--someone--EAGLE3-tiny" / "refs" / "main").write_text("0123abcd")
    dec = SpeculativeDecoder(target, None, drafter="eagle3", spec_length=3, adaptive=False,
                             drafter_options={"heads": "someone/EAGLE3-tiny", "min_confidence": 0.0})
    prompts, want = expected
    assert [r.token_ids for r in dec.generate_ids(prompts[:2], max_new_tokens=MAX_NEW)] == want[:2]


def test_a_hub_id_not_in_the_cache_offline_says_what_to_do(info, hub_cache):
    with pytest.raises(ConfigError, match=r"heads 'someone/missing' are not \(fully\) in the Hugging Face cache and "
                                          r"HF_HUB_OFFLINE is set.*`hf download someone/missing`.*no folder "
                                          r"'someone/missing' exists here either") as caught:
        load_heads("someone/missing", info, "eagle3")
    assert "\n" not in str(caught.value)
