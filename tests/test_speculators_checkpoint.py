"""A speculators checkpoint given as the model (``specdraft serve CHECKPOINT``,
``from_pretrained(CHECKPOINT)``), as vLLM takes it: the target is the checkpoint's verifier, the
drafter the checkpoint's heads, the draft length its default proposal method's. Checkpoints are
built here in the published layout (random weights) for a tiny Llama verifier saved beside them."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from specdraft import ConfigError, SpeculativeDecoder
from specdraft.cli import build_parser, main
from specdraft.cli_args import resolve_drafter, resolve_methods
from specdraft.testing import plain_greedy, repetitive_prompts, tiny_llama, tiny_tokenizer
from specdraft.testing.commands import start_serve, stop_with_ctrl_c

H, HEADS, KV_HEADS, FFN, VOCAB = 32, 4, 2, 64, 64
#: the one-layer Llama config a speculators checkpoint carries (transformers' to_diff_dict)
LAYER = {"hidden_act": "silu", "hidden_size": H, "intermediate_size": FFN, "num_attention_heads": HEADS,
         "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-05, "vocab_size": VOCAB, "model_type": "llama",
         "num_hidden_layers": 1, "max_position_embeddings": 256, "architectures": ["LlamaForCausalLM"]}


def _layer(gen, prefix: str, attn_in: int, input_norm: bool) -> dict:
    def linear(rows, cols):
        return torch.randn(rows, cols, generator=gen) * (1.5 / cols ** 0.5)

    head_dim = H // HEADS
    raw = {"self_attn.q_proj.weight": linear(HEADS * head_dim, attn_in),
           "self_attn.k_proj.weight": linear(KV_HEADS * head_dim, attn_in),
           "self_attn.v_proj.weight": linear(KV_HEADS * head_dim, attn_in),
           "self_attn.o_proj.weight": linear(H, HEADS * head_dim),
           "mlp.gate_proj.weight": linear(FFN, H), "mlp.up_proj.weight": linear(FFN, H),
           "mlp.down_proj.weight": linear(H, FFN), "post_attention_layernorm.weight": torch.rand(H, generator=gen) + 0.5}
    if input_norm:  # EAGLE-3's layer: a norm on the embedding and one on the fused feature
        raw["input_layernorm.weight"] = torch.rand(H, generator=gen) + 0.5
        raw["hidden_norm.weight"] = torch.rand(H, generator=gen) + 0.5
    return {prefix + k: v for k, v in raw.items()}


def write_checkpoint(folder, kind: str, verifier: str | None, speculative_tokens: int = 3, **extra):
    """A speculators ``kind`` ("eagle3" or "eagle") checkpoint for a 4-layer tiny Llama, in ``folder``."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    spec = {"algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}
    config = {"speculators_model_type": kind, "speculators_version": "0.1.0", "transformer_layer_config": LAYER,
              "speculators_config": spec}
    if kind == "eagle3":
        config.update(architectures=["Eagle3Speculator"], draft_vocab_size=VOCAB, norm_before_residual=True,
                      target_hidden_size=None, eagle_aux_hidden_state_layer_ids=[0, 1, 3])
        raw = _layer(gen, "layers.0.", 2 * H, input_norm=True)
        raw.update({"fc.weight": torch.randn(H, 3 * H, generator=gen) * 0.1, "norm.weight": torch.ones(H),
                    "lm_head.weight": torch.randn(VOCAB, H, generator=gen) * 0.5})
    else:
        config.update(architectures=["EagleSpeculator"], transformer_layer_architecture="LlamaDecoderLayer",
                      layernorms=False, fusion_bias=False)
        raw = _layer(gen, "transformer.", H, input_norm=False)
        raw["fusion_fc.weight"] = torch.randn(H, 2 * H, generator=gen) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in raw.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**config, **extra}, indent=1))
    return str(folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The verifier (a 4-layer tiny Llama with its tokenizer) and one checkpoint of each kind for it."""
    root = tmp_path_factory.mktemp("speculators")
    target = root / "verifier"
    tiny_llama(layers=4, seed=6).save_pretrained(target)
    tiny_tokenizer(VOCAB).save_pretrained(target)
    return {"verifier": str(target), **{kind: write_checkpoint(root / kind, kind, str(target))
                                        for kind in ("eagle3", "eagle")}}


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_from_pretrained_a_checkpoint_decodes_its_verifier_exactly(saved, kind):
    """The checkpoint alone: its verifier is the target, its heads the drafter, its speculative_tokens
    the draft length; greedy output equals plain decoding of the verifier."""
    with SpeculativeDecoder.from_pretrained(saved[kind]) as dec:
        assert (dec.target.name, dec.drafter.name, dec.spec_length) == (saved["verifier"], kind, 3)
        assert dec.drafter.options.heads == saved[kind]
        prompts = repetitive_prompts(VOCAB, seed=3)[:3]
        results = dec.generate_ids(prompts, max_new_tokens=12)
        assert [r.token_ids for r in results] == [plain_greedy(dec.model, p, 12) for p in prompts]
    # a draft length and options of the drafter go with it; min_confidence 0 makes the heads draft
    with SpeculativeDecoder.from_pretrained(saved[kind], spec_length=2, adaptive=False,
                                            drafter_options={"min_confidence": 0.0}) as dec:
        assert dec.spec_length == 2
        results = dec.generate_ids(prompts, max_new_tokens=12)
        assert [r.token_ids for r in results] == [plain_greedy(dec.model, p, 12) for p in prompts]
        assert sum(r.stats.drafted_tokens for r in results) > 0


def _resolved(argv: list[str]) -> tuple:
    args = build_parser().parse_args(argv)
    resolve_drafter(args)
    return args.target, args.drafter, args.spec_length, dict(args.drafter_options)


def test_the_cli_reads_a_checkpoint_given_as_the_target(saved):
    ckpt = saved["eagle3"]
    want = (saved["verifier"], "eagle3", 3, {"heads": ckpt})
    assert _resolved(["generate", "--target", ckpt, "hi"]) == want
    assert _resolved(["serve", "--target", ckpt]) == want
    assert _resolved(["serve", "--target", ckpt, "--spec-length", "5", "--drafter", "eagle3",
                      "--drafter-option", "tree_budget=6"]) == (saved["verifier"], "eagle3", 5,
                                                                {"heads": ckpt, "tree_budget": "6"})
    for command, always in (("bench", ""), ("bench-serve", "none")):
        args = build_parser().parse_args([command, "--questions", "q.jsonl", "--target", ckpt])
        resolve_methods(args, "ngram,prompt-lookup", always=always)
        assert (args.target, args.drafters, args.spec_length, args.drafter_options) == (
            saved["verifier"], ",".join(filter(None, (always, "eagle3"))), 3, [("eagle3", "heads", ckpt)])


def test_serve_takes_the_model_as_its_argument(saved, monkeypatch, capsys):
    """``specdraft serve CHECKPOINT``, vLLM's form, builds the decoder --target CHECKPOINT does."""
    built = {}

    def record(**kwargs):
        built.update(kwargs)
        raise ConfigError("stop here")

    monkeypatch.setattr("specdraft.decoder.SpeculativeDecoder.from_pretrained", record)
    assert main(["serve", saved["eagle"], "--port", "0"]) == 2
    assert "stop here" in capsys.readouterr().err
    assert (built["target"], built["drafter"], built["spec_length"], built["drafter_options"]) == (
        saved["verifier"], "eagle", 3, {"heads": saved["eagle"]})


@pytest.mark.server
def test_specdraft_serve_a_checkpoint(saved, tmp_path):
    """The real command with the checkpoint alone: serves the verifier with the checkpoint's drafter,
    and answers as plain decoding of the verifier does."""
    served = start_serve(tmp_path, saved["eagle3"], "--dtype", "float64", "--max-batch", "2")
    try:
        assert served.ready.startswith(f"specdraft: serving {saved['verifier']} with drafter eagle3 on http://")
        prompt = repetitive_prompts(VOCAB, seed=3)[0]
        body = {"model": saved["verifier"], "prompt": prompt, "max_tokens": 10, "temperature": 0}
        answer = httpx.post(f"{served.base}/v1/completions", json=body, timeout=120).json()
        want = plain_greedy(tiny_llama(layers=4, seed=6), prompt, 10)
        assert answer["choices"][0]["text"] == tiny_tokenizer(VOCAB).decode(want)
    finally:
        stop_with_ctrl_c(served.proc)
    assert "Traceback" not in served.stderr.read_text()


@pytest.mark.parametrize("argv, says", [
    (["--drafter", "ngram"], "--drafter 'ngram': the model '{eagle3}' is a speculators eagle3 checkpoint, drafted by "
                             "eagle3; leave it out, or give the target '{verifier}' as the model with it"),
    (["--drafter-option", "heads=other"], "--drafter-option heads=other: the model '{eagle3}' is a speculators "
                                          "checkpoint, whose heads are its own"),
    (["--speculative-config", '{"method": "ngram"}'], "--speculative-config: the model '{eagle3}' is a speculators "
                                                      "checkpoint, which names the drafter (eagle3, its own heads)"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "x"],
     "--speculative-algorithm: the model '{eagle3}' is a speculators checkpoint"),
    (["--target", "other"], "the model is given twice, as '{eagle3}' and as --target 'other'; give one"),
])
def test_a_checkpoint_with_a_conflicting_drafter_is_one_line(saved, monkeypatch, capsys, argv, says):
    monkeypatch.setattr("specdraft.models.load_target", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", saved["eagle3"], "--port", "0", *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and says.format(**saved) in err[0], err


@pytest.mark.parametrize("change, says", [
    (dict(speculators_model_type="dflash", speculators_config={"algorithm": "dflash", "verifier": {
        "name_or_path": "x"}}), "is of algorithm 'dflash', which specdraft does not run; it runs eagle3 and eagle"),
    (dict(speculators_config={"algorithm": "eagle3", "verifier": {}}),
     "names no verifier (speculators_config.verifier.name_or_path): give the target explicitly and the checkpoint "
     "as its drafter: --target TARGET --drafter eagle3 --drafter-option heads="),
    (dict(speculators_config={"algorithm": "eagle3", "verifier": {"name_or_path": "x"}, "proposal_methods": [
        {"proposal_type": "greedy", "speculative_tokens": 40}]}), "drafts speculative_tokens=40 tokens; specdraft "
                                                                   "drafts 1 to 16: give a draft length"),
])
def test_a_checkpoint_specdraft_cannot_take_as_the_model_is_one_line(saved, tmp_path, capsys, change, says):
    ckpt = write_checkpoint(tmp_path / "ckpt", "eagle3", saved["verifier"], **change)
    with pytest.raises(ConfigError) as caught:
        SpeculativeDecoder.from_pretrained(ckpt)
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert main(["generate", "--target", ckpt, "hi"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and says in err[0], err


def test_a_checkpoint_for_another_target_names_its_verifier(saved):
    """The checkpoint as the drafter of a target it was not made for (another width): refused,
    naming the verifier the checkpoint says it was trained for."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2)).double()
    with pytest.raises(ConfigError) as caught:
        SpeculativeDecoder(target, None, drafter="eagle3", drafter_options={"heads": saved["eagle3"]})
    message = str(caught.value)
    assert "but target" in message and f"they were trained for {saved['verifier']!r} (their verifier)" in message
    assert "\n" not in message
