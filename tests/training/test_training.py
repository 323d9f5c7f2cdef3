"""Training: the loop lowers a loss and resumes; distill builds a compact draft that is exact."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft import ConfigError, SpeculativeDecoder
from specdraft.testing import plain_greedy, repetitive_prompts, tiny_llama
from specdraft.training import load_prompts, train


def test_loop_lowers_the_loss_and_resumes(tmp_path, capsys):
    def run(steps):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 4))
        losses = train({"w": w}, lambda step: ((w - torch.eye(4)) ** 2).mean(), steps=steps, out_dir=tmp_path,
                       lr=0.05, warmup=2, checkpoint_every=10)
        return w.detach().clone(), losses

    w, losses = run(30)
    assert losses[-1] < losses[0] / 4
    again, resumed = run(30)  # the finished checkpoint: nothing left to train
    assert resumed == losses and torch.equal(again, w)
    assert "resuming from step 30 of 30" in capsys.readouterr().err
    longer, more = run(40)  # another schedule: not resumed, trained from step 0
    assert len(more) == 40 and more[:2] == losses[:2] and more[10] != losses[10]
    assert "training settings changed (steps 30 -> 40): not resuming" in capsys.readouterr().err


def test_load_prompts_reads_every_schema(tmp_path):
    files = {
        "si.jsonl": {"instruction": "Rewrite it.", "instances": [{"input": "Some text", "output": "x"}]},
        "gsm.jsonl": {"question": "What is 2+2?", "answer": "4"},
        "sb.jsonl": {"question_id": 1, "category": "c", "turns": ["Hello?"]},
        "plain.jsonl": {"prompt": "Tell me a joke."},
    }
    for name, row in files.items():
        (tmp_path / name).write_text(json.dumps(row) + "\n")
    prompts = load_prompts([tmp_path / n for n in files])
    assert sorted(prompts) == sorted(["Rewrite it.\n\nSome text", "What is 2+2?", "Hello?", "Tell me a joke."])
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts([tmp_path / "nope.jsonl"])


@pytest.mark.parametrize("objective", ["kl", "ce"])
def test_distill_builds_an_exact_compact_draft(tmp_path, smol_tokenizer, objective):
    from specdraft.drafters.common.compact_draft import FORMAT_FILE
    from specdraft.training.distill import distill

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Count to {i}."}) for i in range(6)) + "\n")
    target = tiny_llama(vocab_size=len(smol_tokenizer), seed=5, max_positions=512)
    out = distill(target, smol_tokenizer, "tiny", [prompts], tmp_path / "draft", num_prompts=6, max_new_tokens=8,
                  layers=1, head_tokens=64, steps=4, batch_size=2, objective=objective, progress=False)
    meta = json.loads((out / FORMAT_FILE).read_text())
    assert meta["target"] == "tiny" and 0 < meta["head_tokens"] <= 64 and meta["steps"] == 4
    assert meta["objective"] == objective and len(json.loads((out / "losses.json").read_text())["losses"]) == 4
    assert not any("embed_tokens" in k for k in __import__("safetensors.torch").torch.load_file(out / "model.safetensors"))

    dec = SpeculativeDecoder(target, smol_tokenizer, drafter="draft-model", spec_length=3,
                             drafter_options={"model": str(out), "dtype": "float64"})
    assert dec.drafter.model.model.embed_tokens is target.get_input_embeddings()  # shared, not copied
    for p in repetitive_prompts(len(smol_tokenizer), seed=4)[:2]:
        assert dec.generate_ids([p], max_new_tokens=12)[0].token_ids == plain_greedy(target, p, 12)

    other = tiny_llama(vocab_size=len(smol_tokenizer), seed=6, max_positions=512)
    with pytest.raises(ConfigError, match="was trained for target 'tiny'.*train one for this target"):
        SpeculativeDecoder(other, smol_tokenizer, drafter="draft-model", drafter_options={"model": str(out)})


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "mlp-speculator"])
def test_train_heads_runs_both_phases_and_the_heads_are_exact(tmp_path, smol_tokenizer, kind):
    from safetensors.torch import load_file

    from specdraft.drafters.heads.formats import FORMAT_FILE
    from specdraft.training.heads import train_heads

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"<<{i}+{i}>>It is {2 * i}."})
                                 for i in range(6)) + "\n")
    target = tiny_llama(vocab_size=len(smol_tokenizer), seed=5, max_positions=512)
    out = train_heads(target, smol_tokenizer, "tiny", kind, [prompts], tmp_path / "heads", num_texts=6, num_prompts=4,
                      max_new_tokens=8, steps=7, batch_size=2, head_tokens=16 if kind == "eagle3" else 64,
                      progress=False)
    meta = json.loads((out / FORMAT_FILE).read_text())
    assert meta["kind"] == kind and meta["steps"] == 7 and meta["phase1_steps"] == 5 and meta["head_tokens"] <= 64
    assert meta["text_sequences"] == 6 and meta["answer_sequences"] == 4
    assert len(json.loads((out / "losses.json").read_text())["losses"]) == 7
    saved = load_file(out / "heads.safetensors")
    assert not any(v.shape[0] == len(smol_tokenizer) for v in saved.values())  # no copy of embeddings or LM head
    dec = SpeculativeDecoder(target, smol_tokenizer, drafter=kind, spec_length=3, drafter_options={"heads": str(out)})
    if kind == "eagle3":  # its draft vocabulary: the most frequent answer tokens and the specials, kept as d2t
        from specdraft.drafters.heads.modules import eagle3_default_layers
        from specdraft.training.data import chat_sequences, frequent_tokens, load_examples

        module = dec.drafter.module
        assert "head_ids" not in saved and meta["head_tokens"] == len(saved["d2t"]) == module.lm_head.weight.shape[0]
        assert module.aux_layers == eagle3_default_layers(2) and meta["unrolled_steps"] == 4  # the tiny target's
        answers = json.loads((out / "work" / "sequences.json").read_text())["data"]
        texts = chat_sequences(smol_tokenizer, load_examples([prompts], limit=6))
        specials = [smol_tokenizer.eos_token_id, smol_tokenizer.bos_token_id, smol_tokenizer.pad_token_id]
        expected = frequent_tokens(answers + texts, 16, [t for t in specials if t is not None])
        assert module.head_ids().tolist() == expected.tolist() and len(expected) == 16
    for p in repetitive_prompts(len(smol_tokenizer), seed=4)[:2]:
        assert dec.generate_ids([p], max_new_tokens=12)[0].token_ids == plain_greedy(target, p, 12)


def test_draft_model_without_a_model_or_shipped_draft_says_what_to_do(tiny_model):
    with pytest.raises(ConfigError, match="no shipped draft for target.*--drafter-option model="):
        SpeculativeDecoder(tiny_model, None, drafter="draft-model")


def test_the_target_writes_its_own_training_prompts(tmp_path, smol_tokenizer):
    from specdraft.training.data import self_prompted_generations, user_turn_prefix

    prefix = user_turn_prefix(smol_tokenizer)
    assert smol_tokenizer.decode(prefix).endswith("<|im_start|>user\n")
    target = tiny_llama(vocab_size=len(smol_tokenizer), seed=5, max_positions=512)  # never ends a turn: fallback
    seqs = self_prompted_generations(target, smol_tokenizer, tmp_path / "s.json", 3, max_new_tokens=4, batch_size=2)
    assert len(seqs) == 3 and len({tuple(s["ids"]) for s in seqs}) == 3
    for s in seqs:
        assert s["ids"][: len(prefix)] == prefix and len(s["ids"]) == s["prompt_len"] + 4
    # cached: the same inputs reuse the answers (the generation would give others: it samples)
    assert self_prompted_generations(target, smol_tokenizer, tmp_path / "s.json", 3, max_new_tokens=4,
                                     batch_size=2) == seqs


def test_document_prompts_wrap_the_targets_own_answers(smol_tokenizer):
    from specdraft.training.data import DOCUMENT_TASKS, document_prompts

    answers = [f"Answer number {i} talks about topic {i} at some length." for i in range(5)]
    seqs = [{"ids": [1, 2] + smol_tokenizer(a, add_special_tokens=False).input_ids, "prompt_len": 2} for a in answers]
    prompts = document_prompts(smol_tokenizer, seqs, 14, seed=0, min_tokens=4, max_parts=2)
    assert len(prompts) == 14
    for i, p in enumerate(prompts):
        head, _, tail = DOCUMENT_TASKS[i % len(DOCUMENT_TASKS)].partition("{text}")
        assert p.startswith(head) and p.endswith(tail)
        assert 1 <= sum(a in p for a in answers) <= 2
    with pytest.raises(ConfigError, match="no answer of 999"):
        document_prompts(smol_tokenizer, seqs, 3, min_tokens=999)


def test_training_precision(monkeypatch):
    from specdraft.training import loop

    assert loop.autocast_dtype("float32", "cpu") is None
    assert loop.autocast_dtype("bfloat16", "cpu") is torch.bfloat16
    monkeypatch.setattr(loop, "_has_bf16_matrix_units", lambda: False)
    assert loop.autocast_dtype("auto", "cpu") is None
    monkeypatch.setattr(loop, "_has_bf16_matrix_units", lambda: True)
    assert loop.autocast_dtype("auto", "cpu") is torch.bfloat16
    with pytest.raises(ConfigError, match="unknown training dtype 'fp8'"):
        loop.autocast_dtype("fp8", "cpu")


def test_the_loop_runs_the_loss_under_autocast(tmp_path):
    w = torch.nn.Parameter(torch.randn(8, 8))
    seen = []

    def loss_fn(step):
        out = w @ torch.randn(8, 8)
        seen.append(out.dtype)
        return out.float().pow(2).mean()

    train({"w": w}, loss_fn, steps=2, out_dir=tmp_path, progress=False, autocast=torch.bfloat16)
    assert seen == [torch.bfloat16] * 2 and w.dtype == torch.float32


def test_copy_gate_learns_to_copy_where_the_answer_repeats_the_prompt(tmp_path, tiny_model):
    """Answers that repeat their prompt: the gate's mixture likelihood rises, and the draft's
    held-out guesses (through the gate, as the drafter chooses them) get more right."""
    from specdraft.drafters.common.compact_draft import build_compact_draft
    from specdraft.training.copy_gate import fit_copy_gate, gate_examples, mixture_nll
    from specdraft.training.distill import draft_gate_source
    from specdraft.training.evaluate import draft_model_predictor, held_out_acceptance

    g = torch.Generator().manual_seed(0)

    def sequence():
        prompt = torch.randint(0, 64, (12,), generator=g).tolist()
        return {"ids": prompt + prompt[:10], "prompt_len": 12, "greedy": True}

    train_seqs, held = [sequence() for _ in range(40)], [sequence() for _ in range(8)]
    draft = build_compact_draft(tiny_model, 1, torch.arange(64))
    before = held_out_acceptance(draft_model_predictor(draft, 2), held, None, 2, dtype=torch.float64)
    losses = fit_copy_gate(draft, draft_gate_source(draft), train_seqs, tmp_path / "gate", steps=60, batch=256,
                           progress=False)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    ex = gate_examples(draft_gate_source(draft), held)
    with torch.no_grad():
        assert float(mixture_nll(draft.copy_gate, ex)) < 1.0
    after = held_out_acceptance(draft_model_predictor(draft, 2), held, None, 2, dtype=torch.float64)
    assert after[0] > 0.8 > before[0] + 0.3
