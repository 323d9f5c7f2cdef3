"""``specdraft train-heads``: train Medusa, EAGLE or MLP-speculator heads on a frozen target.

Two phases, 5:2 in steps (Medusa's recipe):

1. **Text.** Prompts with reference answers (self-instruct outputs, GSM8K solutions),
   chat-formatted; the heads learn the causal-LM objective (the answer's real next tokens)
   over the target's frozen hidden states.
2. **Self-distillation.** The target's own answers to training prompts (greedy plus a
   sampled share); the heads learn to match the target's distribution at every answer
   position, which is what verification rewards.

The target's hidden states are computed once per sequence and cached (``DIR/work``), as
are its answers; training steps then only run the heads. The target's embeddings and LM
head are shared and frozen; the output vocabulary can be trimmed to the most frequent
answer tokens (``head_tokens``). Training uses :func:`specdraft.training.loop.train`, the
loop ``specdraft distill`` uses: resumable checkpoints, a progress bar, a loss plot.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..drafters.common.compact_draft import target_fingerprint
from ..decoder import describe_target
from ..drafters.heads.formats import load_heads, save_heads
from ..drafters.heads.modules import KINDS, SharedHead, build_heads
from ..errors import ConfigError
from .batches import eagle_unroll, padded_batch
from .copy_gate import GateSource, fit_copy_gate
from .data import (chat_sequences, frequent_tokens, load_examples, sequences_key, target_answers, target_features,
                   target_identity)
from .evaluate import heads_predictor, held_out_acceptance, split_held_out
from .io import key_of, write_atomic
from .loop import autocast_dtype, batch_indices, check_lr, seeded, step_generator, train

#: EAGLE-1's weighting of its two losses: feature regression 1, token classification 0.1
EAGLE_CLASSIFICATION_WEIGHT = 0.1
#: drafting steps EAGLE is trained over (each after the first is fed the layer's own guesses)
EAGLE_DEPTH = 2


def token_loss(out: torch.Tensor, at: int, ids, feats, answer, head: SharedHead, soft: bool,
                student=None) -> torch.Tensor:
    """Cross-entropy of the guesses from ``out # [B, T, H]`` (T = W - at) for the tokens at ``at..W-1``.

    Only answer positions count, and only they go through the head (most of the cost).
    ``student`` maps features to logits over ``head``'s vocabulary (default: ``head.small``,
    the target's own rows). Hard: the sequence's real tokens. Soft: the target's distribution
    there, from its state one position earlier (restricted to the head's vocabulary and
    renormalised).
    """
    mask = answer[:, at:]  # [B, T]
    if not bool(mask.any()):
        return out.sum() * 0
    logits = (student or head.small)(out[mask]).float()  # [M, N]
    if soft:
        with torch.no_grad():
            target = head.small(feats[:, at - 1 : -1][mask]).float().softmax(-1)  # [M, N]
        return -(target * logits.log_softmax(-1)).sum(-1).mean()
    return F.cross_entropy(logits, head.to_small(ids[:, at:][mask]), ignore_index=-100)


def heads_loss(kind: str, module, head: SharedHead, embeddings, ids, feats, valid, answer, soft: bool,
               noise: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Teacher-forced training loss of one padded batch (see :func:`padded_batch`); ``generator``
    draws EAGLE's input noise (default: torch's global one)."""
    width = ids.shape[1]
    if kind == "medusa":
        losses = []
        for i in range(1, module.num_heads + 1):  # head i on f_t guesses x_{t+i+1}
            if width <= i + 1:
                break
            out = module.blocks[i - 1](feats[:, : width - i - 1])
            losses.append(token_loss(out, i + 1, ids, feats, answer, head, soft))
        return torch.stack(losses).mean()
    if kind == "mlp-speculator":
        losses, state = [], feats[:, : width - 2]  # stage i on (state_{i-1}, x_{t+i}) guesses x_{t+i+1}
        for i in range(1, module.num_stages + 1):
            if width <= i + 1:
                break
            n = width - i - 1
            state, out = module.stage(i - 1, state[:, :n], embeddings(ids[:, i : i + n]))
            losses.append(token_loss(out, i + 1, ids, feats, answer, head, soft))
        return torch.stack(losses).mean()
    if kind == "eagle":
        return _eagle_loss(module, head, embeddings, ids, feats, valid, answer, soft, noise, generator=generator)
    raise ConfigError(f"unknown head kind {kind!r}; expected one of {', '.join(KINDS)}")


def _eagle_loss(module, head, embeddings, ids, feats, valid, answer, soft: bool, noise: float,
                depth: int = EAGLE_DEPTH, token_weight: float = EAGLE_CLASSIFICATION_WEIGHT,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """EAGLE's loss over ``depth`` drafting steps (:func:`eagle_unroll`), summed.

    Each step: smooth-L1 between guessed and true features plus ``token_weight`` x the token
    loss of the guesses. Without the steps after the first, the layer never sees its own
    guesses as input and later draft tokens are rarely right.
    """
    loss = 0
    for s, guess in enumerate(eagle_unroll(module, embeddings, ids, feats, depth, noise, generator), 1):
        target, keep = feats[:, s:], valid[:, s:]  # f_{j+s}
        regression = F.smooth_l1_loss(guess[keep].float(), target[keep].float())
        loss = loss + regression + token_weight * token_loss(guess[:, :-1], s + 1, ids, feats, answer, head, soft)
    return loss


def train_heads(target, tokenizer, target_name: str, kind: str, prompt_files: Sequence[str], out_dir: str | Path,
                num_texts: int = 600, num_prompts: int = 600, self_prompts: int = 0,
                document_prompts: int = 0, max_new_tokens: int = 128,
                steps: int = 700,
                batch_size: int = 8, lr: float = 1e-3, head_tokens: int | None = 8192, gen_batch_size: int = 16,
                seed: int = 0,
                work_dir: str | Path | None = None, progress: bool = True, train_dtype: str = "auto",
                copy_gate: bool = True, gate_steps: int = 300, init_from: str | Path | None = None,
                **head_config) -> Path:
    """Train heads of ``kind`` for ``target`` and save them in specdraft's format in ``out_dir``.

    ``work_dir`` (default ``out_dir/work``) caches the target's answers and hidden states,
    which do not depend on the kind: point several runs at one to compute them once.
    Checkpoints go to ``work_dir/<kind>``. Then, unless ``copy_gate`` is False, the heads'
    copy gate is fitted with the heads frozen (``gate_steps``, checkpoints in
    ``work_dir/<kind>-copy-gate``). ``init_from``: start from the heads in that folder
    (specdraft's format, same kind; their vocabulary is kept) instead of fresh ones; with
    ``steps=0`` only the copy gate is fitted.

    The same inputs and ``seed`` give the same heads, bit for bit on the same machine and
    threads, whether or not the run was interrupted and resumed.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown head kind {kind!r}; expected one of {', '.join(KINDS)}")
    check_lr(lr)
    out_dir = Path(out_dir)
    work = Path(work_dir) if work_dir else out_dir / "work"
    (work / kind).mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    device = target.device

    texts = chat_sequences(tokenizer, load_examples(prompt_files, limit=num_texts, seed=seed)) if steps else []
    answers, answer_states = target_answers(target, tokenizer, prompt_files, work, num_prompts, self_prompts,
                                            max_new_tokens=max_new_tokens, batch_size=gen_batch_size, seed=seed,
                                            progress=progress,
                                            document_prompts_count=document_prompts)
    text_states = target_features(target, texts, work / "text_states.safetensors", progress=progress,
                                  desc="target states (text)") if texts else []
    data_seconds = time.perf_counter() - began
    keep, held = split_held_out(answers)  # greedy answers never trained on, to measure acceptance
    held_answers, held_states = [answers[i] for i in held], [answer_states[i] for i in held]
    answers, answer_states = [answers[i] for i in keep], [answer_states[i] for i in keep]

    specials = [t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if t is not None]
    initial = None
    if init_from is not None:
        module, head, initial = load_heads(init_from, describe_target(target, tokenizer, target_name), kind,
                                     dtype=torch.float32, device=device)
        if hasattr(module, "copy_gate"):
            del module.copy_gate  # refitted below, for the heads as they end up
    else:
        head_ids = frequent_tokens(answers + texts, head_tokens, specials) if head_tokens else None
        lm_head = target.get_output_embeddings()
        head = SharedHead(lm_head, lm_head.weight.shape[0], head_ids).to(device=device, dtype=torch.float32)
        with seeded(seed):
            module = build_heads(kind, target.config.get_text_config(), **head_config)
        module = module.to(device=device, dtype=torch.float32)
    module.train()
    params = dict(module.named_parameters())
    embeddings = target.get_input_embeddings()
    with torch.no_grad():  # EAGLE's input noise is relative to the states' own scale
        noise = 0.1 * float(torch.cat(answer_states[:50]).float().std()) if kind == "eagle" else 0.0
    phase1 = round(steps * 5 / 7)

    def loss_fn(step: int) -> torch.Tensor:  # a function of the step alone, so that resuming is exact
        phase = 1 if step < phase1 else 2
        seqs, states = (texts, text_states) if phase == 1 else (answers, answer_states)
        picked = batch_indices(step - (0 if phase == 1 else phase1), batch_size, len(seqs), seed + phase)
        ids, feats, valid, answer = padded_batch([seqs[i] for i in picked], [states[i] for i in picked], torch.float32,
                                           device)
        return heads_loss(kind, module, head, lambda t: embeddings(t).float(), ids, feats, valid, answer,
                          soft=phase == 2, noise=noise, generator=step_generator(seed, step, device))

    target_id = target_identity(target, tokenizer)
    settings = {"kind": kind, "texts": sequences_key(texts), "answers": sequences_key(answers), "target": target_id,
                "head_tokens": key_of(head.head_ids.tolist() if head.head_ids is not None else None),
                "batch_size": batch_size, "seed": seed}
    losses = []
    if steps:
        with torch.enable_grad():
            losses = train(params, loss_fn, steps, work / kind, lr=lr, progress=progress,
                           desc=f"train-heads ({kind})", autocast=autocast_dtype(train_dtype, target.device),
                           settings=settings)
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    gate_info = {}
    if copy_gate and gate_steps:
        source = heads_gate_source(kind, module, head, lambda t: embeddings(t).float())
        gate_losses = fit_copy_gate(module, source, answers, work / f"{kind}-copy-gate", states=answer_states,
                                    steps=gate_steps, seed=seed, progress=progress, device=device,
                                    settings={"target": target_id})
        if gate_losses:
            gate_info = {"copy_gate": {"steps": gate_steps,
                                       "final_loss": sum(gate_losses[-20:]) / max(1, len(gate_losses[-20:]))}}
    train_seconds = time.perf_counter() - began - data_seconds
    depth = {"medusa": getattr(module, "num_heads", 0), "mlp-speculator": getattr(module, "num_stages", 0)}.get(kind, 4)
    acceptance = held_out_acceptance(heads_predictor(kind, module, head, lambda t: embeddings(t).float(), depth),
                                     held_answers, held_states, depth, device=device) if held_answers else []
    tail = losses[-20:]
    save_heads(module, head, out_dir, target_name, target_fingerprint(embeddings.weight), extra={
        "name": f"{target_name}-{kind}",
        "steps": steps, "phase1_steps": phase1, "batch_size": batch_size, "lr": lr, "train_dtype": train_dtype,
        "text_sequences": len(texts), "answer_sequences": len(answers), "self_prompted": self_prompts,
        "document_prompted": document_prompts,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "held_out": {"answers": len(held_answers), "acceptance_by_position": [round(a, 4) for a in acceptance]},
        "seconds": {"target_answers_and_states": round(data_seconds, 1), "training": round(train_seconds, 1),
                    "total": round(time.perf_counter() - began, 1)},
        "prompt_files": [Path(p).name for p in prompt_files],
        **({"initialised_from": {"folder": Path(init_from).name, **{
            k: v for k, v in initial.items() if k not in ("format", "kind", "target", "target_fingerprint", "config",
                                                          "head_tokens", "copy_gate")}}} if initial else {}),
        **gate_info,
    })
    for name in ("loss.png", "losses.json"):
        if steps and (work / kind / name).is_file():
            write_atomic(out_dir / name, (work / kind / name).read_bytes())
        if gate_info and (work / f"{kind}-copy-gate" / name).is_file():
            write_atomic(out_dir / f"copy_gate_{name}", (work / f"{kind}-copy-gate" / name).read_bytes())
    return out_dir


def first_features(kind: str, module, embeddings, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """The feature each head kind's first guess reads, teacher-forced: ``[B, W, H]`` whose entry
    ``p-1`` guesses token ``p`` (from ``f_{p-2}`` and ``x_{p-1}``; entry 0 is zeros)."""
    if kind == "medusa":
        first = module.blocks[0](feats[:, :-1])
    elif kind == "mlp-speculator":
        first = module.stage(0, feats[:, :-1], embeddings(ids[:, 1:]))[1]
    else:
        first = eagle_unroll(module, embeddings, ids, feats, 1)[0]  # entry j guesses f_{j+1}, hence x_{j+2}
    return torch.cat([torch.zeros_like(first[:, :1]), first], dim=1)


def heads_gate_source(kind: str, module, head: SharedHead, embeddings) -> GateSource:
    """The heads' first guesses, for :func:`~.copy_gate.fit_copy_gate`."""
    return GateSource(features=lambda ids, valid, feats: first_features(kind, module, embeddings, ids, feats),
                      logits=head.small, head_ids=head.head_ids, hidden_size=int(module.config["hidden_size"]))


__all__ = ["first_features", "heads_gate_source", "heads_loss", "token_loss", "train_heads"]
