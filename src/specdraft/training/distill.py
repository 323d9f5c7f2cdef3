"""``specdraft distill``: build a compact draft for a target from the target's own outputs.

1. The target answers training prompts (greedy, plus a share of sampled answers).
2. The draft's output head keeps the ``head_tokens`` most frequent tokens of those answers.
3. The draft (``layers`` decoder layers initialised from the target's first layers, the
   target's embeddings shared and frozen) learns, at every answer position, the target's
   own next-token distribution there (objective "kl", the default: soft labels from the
   target's hidden states through its LM head, restricted to the head's tokens) or just the
   token the target produced (objective "ce").
4. Its copy gate (:class:`~specdraft.drafters.compact_draft.CopyGate`, unless
   ``copy_gate=False``) learns, with the trained draft frozen, how far to trust the token
   that followed the last occurrence of the trailing n-gram over the draft's own guess: it
   maximises the likelihood of the target's tokens under the mixture.
5. It is saved in specdraft's compact format, loadable with ``--drafter draft-model
   --drafter-option model=DIR``.

Every stage is resumable: answers and target states are cached in ``DIR/work/`` (or
``--work``, which ``train-heads`` can share) and checkpoints in ``WORK/draft-model/``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Sequence

import torch

from ..drafters.compact_draft import CopyGate, build_compact_draft, save_compact_draft, target_fingerprint
from ..drafters.heads.modules import SharedHead
from ..errors import ConfigError
from .data import frequent_tokens, target_answers
from .evaluate import draft_model_predictor, held_out_acceptance, split_held_out
from .heads import padded_batch, token_loss
from .loop import autocast_dtype, train


def distill(target, tokenizer, target_name: str, prompt_files: Sequence[str], out_dir: str | Path,
            num_prompts: int = 600, self_prompts: int = 0, document_prompts: int = 0, sampled_fraction: float = 0.25,
            max_new_tokens: int = 128, layers: int = 2, head_tokens: int = 8192, steps: int = 300, batch_size: int = 8,
            lr: float = 5e-4, gen_batch_size: int = 16, seed: int = 0, objective: str = "kl",
            work_dir: str | Path | None = None, progress: bool = True, train_dtype: str = "auto",
            copy_gate: bool = True, gate_steps: int = 300) -> Path:
    """Build and train a compact draft; ``objective`` "kl" matches the target's distributions, "ce" its tokens.

    ``work_dir`` (default ``out_dir/work``) caches the target's answers (and, for "kl", its
    hidden states); it can be shared with ``train-heads``. Checkpoints go to ``work_dir/draft-model``.
    """
    if objective not in ("kl", "ce"):
        raise ConfigError(f"objective must be 'kl' or 'ce', not {objective!r}")
    out_dir = Path(out_dir)
    work = Path(work_dir) if work_dir else out_dir / "work"
    (work / "draft-model").mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()

    sequences, states = target_answers(target, tokenizer, prompt_files, work, num_prompts, self_prompts,
                                       sampled_fraction, max_new_tokens, gen_batch_size, seed,
                                       states=objective == "kl", progress=progress,
                                       document_prompts_count=document_prompts)
    gen_seconds = time.perf_counter() - began
    keep, held = split_held_out(sequences)  # greedy answers never trained on, to measure acceptance
    held_sequences = [sequences[i] for i in held]
    sequences = [sequences[i] for i in keep]
    states = [states[i] for i in keep] if states is not None else None

    specials = [t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if t is not None]
    head_ids = frequent_tokens(sequences, head_tokens, specials).to(target.device)
    draft = build_compact_draft(target, layers, head_ids)
    draft.train()
    for p in draft.model.embed_tokens.parameters():
        p.requires_grad_(False)
    params = {n: p for n, p in draft.named_parameters() if p.requires_grad}
    teacher = SharedHead(target.get_output_embeddings(), draft.config.vocab_size, head_ids)
    rng = random.Random(seed)
    order: list[int] = []
    width = target.config.get_text_config().hidden_size

    def loss_fn(step: int) -> torch.Tensor:
        nonlocal order
        if len(order) < batch_size:
            order = list(range(len(sequences)))
            rng.shuffle(order)
        picked = [order.pop() for _ in range(batch_size)]
        feats = [states[i] for i in picked] if states is not None else [torch.zeros(1, width)] * batch_size
        ids, feats, valid, answer = padded_batch([sequences[i] for i in picked], feats, target.dtype, target.device)
        hidden = draft.model(input_ids=ids, attention_mask=valid.long()).last_hidden_state  # [batch, width, dim]
        # the state at p-1 predicts the answer token at p
        return token_loss(hidden[:, :-1], 1, ids, feats, answer, teacher, soft=states is not None,
                          student=draft.lm_head.proj)

    with torch.enable_grad():
        losses = train(params, loss_fn, steps, work / "draft-model", lr=lr, progress=progress, desc="distill",
                       autocast=autocast_dtype(train_dtype, target.device))
    draft.eval()
    gate_info = {}
    if copy_gate:
        gate_losses = train_copy_gate(draft, sequences, work / "copy-gate", gate_steps, seed=seed, progress=progress)
        if gate_losses:
            gate_info = {"copy_gate": {"steps": gate_steps,
                                       "final_loss": sum(gate_losses[-20:]) / max(1, len(gate_losses[-20:]))}}
        elif progress:
            print("copy gate: no answer position has a copy candidate, so the draft has no copy gate")
    acceptance = held_out_acceptance(draft_model_predictor(draft, 4), held_sequences, None, 4,
                                     dtype=target.dtype, device=target.device) if held_sequences else []
    train_tokens = sum(len(s["ids"]) - s["prompt_len"] for s in sequences)
    save_compact_draft(draft, out_dir, target_name, target_fingerprint(target.get_input_embeddings().weight), extra={
        "name": f"{target_name}-draft-{layers}L",
        "layers": layers, "prompts": len(sequences), "self_prompted": self_prompts, "document_prompted": document_prompts,
        "answer_tokens": train_tokens, "steps": steps,
        "batch_size": batch_size, "objective": objective, "train_dtype": train_dtype, "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "held_out": {"answers": len(held_sequences), "acceptance_by_position": [round(a, 4) for a in acceptance]},
        "generation_seconds": round(gen_seconds, 1), "total_seconds": round(time.perf_counter() - began, 1),
        "prompt_files": [Path(p).name for p in prompt_files], **gate_info,
    })
    for name in ("loss.png", "losses.json"):
        if (work / "draft-model" / name).is_file():
            (out_dir / name).write_bytes((work / "draft-model" / name).read_bytes())
        if gate_info and (work / "copy-gate" / name).is_file():
            (out_dir / f"copy_gate_{name}").write_bytes((work / "copy-gate" / name).read_bytes())
    return out_dir


def gate_examples(draft, sequences: Sequence[dict], batch_size: int = 8) -> dict[str, torch.Tensor]:
    """What the copy gate learns from, at every answer position of ``sequences`` that has a copy
    candidate and where the draft or the candidate can produce the target's token: the draft's
    hidden state before it, the matched n-gram length, the draft's log-probabilities of the
    candidate and of the target's token, and whether the candidate is the target's token."""
    from ..drafters.prompt_lookup import lookup

    gate = getattr(draft, "copy_gate", None)
    lo, hi = (gate.min_ngram, gate.max_ngram) if gate is not None else (CopyGate.MIN_NGRAM, CopyGate.MAX_NGRAM)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("hidden", "match", "logp_copy", "logp_token", "hit")}
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            seqs = list(sequences[start : start + batch_size])
            ids, _, valid, _ = padded_batch(seqs, [torch.zeros(1, 1)] * len(seqs), torch.float32, draft.device)
            hidden = draft.model(input_ids=ids, attention_mask=valid.long()).last_hidden_state
            for b, seq in enumerate(seqs):
                tokens = seq["ids"]
                found = [(p, *lookup(tokens[:p], 1, lo, hi))
                         for p in range(seq["prompt_len"], len(tokens))]
                found = [(p, c[0], n) for p, c, n in found if c]
                if not found:
                    continue
                pos = torch.tensor([p for p, _, _ in found], device=draft.device)
                copy = torch.tensor([c for _, c, _ in found], device=draft.device)
                h = hidden[b, pos - 1]  # [n, dim]: the state before position p guesses token p
                logp = draft.lm_head(h).float().log_softmax(-1)  # [n, vocab]
                truth = ids[b, pos]
                parts["hidden"].append(h.float())
                parts["match"].append(torch.tensor([n for _, _, n in found], device=draft.device))
                parts["logp_copy"].append(logp.gather(1, copy[:, None])[:, 0])  # the gate clamps it
                parts["logp_token"].append(logp.gather(1, truth[:, None])[:, 0].clamp(min=-30.0))
                parts["hit"].append((copy == truth).float())
    out = {k: torch.cat(v) for k, v in parts.items()}
    useful = (out["hit"] > 0) | (out["logp_token"] > -30.0)  # else no gate changes the likelihood
    return {k: v[useful] for k, v in out.items()}


def mixture_nll(gate: CopyGate, ex: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean negative log-likelihood of the target's tokens under the copy mixture."""
    g = gate(ex["hidden"], ex["match"], ex["logp_copy"])
    likelihood = (1 - g) * ex["logp_token"].exp() + g * ex["hit"]
    return -(likelihood + 1e-9).log().mean()


def train_copy_gate(draft, sequences: Sequence[dict], out_dir: Path, steps: int = 300, batch: int = 4096,
                    lr: float = 1e-2, seed: int = 0, progress: bool = True) -> list[float]:
    """Attach a :class:`CopyGate` to ``draft`` (frozen) and fit it to ``sequences``; returns the losses
    (none, and no gate attached, when no answer position has a copy candidate)."""
    ex = gate_examples(draft, sequences)
    if not len(ex["hit"]):
        return []
    if getattr(draft, "copy_gate", None) is None:
        draft.copy_gate = CopyGate(draft.config.hidden_size).to(device=draft.device, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    params = dict(draft.copy_gate.named_parameters())

    def loss_fn(step: int) -> torch.Tensor:
        pick = torch.randint(0, len(ex["hit"]), (batch,), generator=generator).to(draft.device)
        return mixture_nll(draft.copy_gate, {k: v[pick] for k, v in ex.items()})

    with torch.enable_grad():
        return train(params, loss_fn, steps, out_dir, lr=lr, progress=progress, desc="copy gate")


__all__ = ["distill", "train_copy_gate"]
