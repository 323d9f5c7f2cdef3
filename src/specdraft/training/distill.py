"""``specdraft distill``: build a compact draft for a target from the target's own outputs.

1. The target answers training prompts (greedy, plus a share of sampled answers).
2. The draft's output head keeps the ``head_tokens`` most frequent tokens of those answers.
3. The draft (``layers`` decoder layers initialised from the target's first layers, the
   target's embeddings shared and frozen) learns, at every answer position, the target's
   own next-token distribution there (objective "kl", the default: soft labels from the
   target's hidden states through its LM head, restricted to the head's tokens) or just the
   token the target produced (objective "ce").
4. Its copy gate (:class:`~specdraft.drafters.common.copy_gate.CopyGate`, unless
   ``copy_gate=False``) learns, with the trained draft frozen, how far to trust the token
   that followed the last occurrence of the trailing n-gram over the draft's own guess: it
   maximises the likelihood of the target's tokens under the mixture.
5. It is saved in specdraft's compact format, loadable with ``--drafter draft-model
   --drafter-option model=DIR``.

Every stage is resumable: answers and target states are cached in ``DIR/work/`` (or
``--work``, which ``train-heads`` can share) and checkpoints in ``WORK/draft-model/``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch

from ..drafters.common.compact_draft import build_compact_draft, save_compact_draft, target_fingerprint
from ..drafters.heads.modules import SharedHead
from ..errors import ConfigError
from .copy_gate import GateSource, fit_copy_gate
from .data import frequent_tokens, sequences_key, target_answers, target_identity
from .evaluate import draft_model_predictor, held_out_acceptance, split_held_out
from .heads import padded_batch, token_loss
from .io import key_of, write_atomic
from .loop import autocast_dtype, batch_indices, check_lr, seeded, train


def distill(target, tokenizer, target_name: str, prompt_files: Sequence[str], out_dir: str | Path,
            num_prompts: int = 600, self_prompts: int = 0, document_prompts: int = 0, sampled_fraction: float = 0.25,
            max_new_tokens: int = 128, layers: int = 2, head_tokens: int = 8192, steps: int = 300, batch_size: int = 8,
            lr: float = 5e-4, gen_batch_size: int = 16, seed: int = 0, objective: str = "kl",
            work_dir: str | Path | None = None, progress: bool = True, train_dtype: str = "auto",
            copy_gate: bool = True, gate_steps: int = 300) -> Path:
    """Build and train a compact draft; ``objective`` "kl" matches the target's distributions, "ce" its tokens.

    ``work_dir`` (default ``out_dir/work``) caches the target's answers (and, for "kl", its
    hidden states); it can be shared with ``train-heads``. Checkpoints go to ``work_dir/draft-model``.
    The same inputs and ``seed`` give the same draft, bit for bit on the same machine and
    threads, whether or not the run was interrupted and resumed.
    """
    if objective not in ("kl", "ce"):
        raise ConfigError(f"objective must be 'kl' or 'ce', not {objective!r}")
    target_layers = target.config.get_text_config().num_hidden_layers
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= target_layers:
        raise ConfigError(f"layers must be 1 to {target_layers} (the target's layer count), not {layers!r}")
    check_lr(lr)
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
    with seeded(seed):  # every weight is then copied from the target, but none is left to chance
        draft = build_compact_draft(target, layers, head_ids)
    draft.train()
    for p in draft.model.embed_tokens.parameters():
        p.requires_grad_(False)
    params = {n: p for n, p in draft.named_parameters() if p.requires_grad}
    teacher = SharedHead(target.get_output_embeddings(), draft.config.vocab_size, head_ids)
    width = target.config.get_text_config().hidden_size

    def loss_fn(step: int) -> torch.Tensor:  # a function of the step alone, so that resuming is exact
        picked = batch_indices(step, batch_size, len(sequences), seed)
        feats = [states[i] for i in picked] if states is not None else [torch.zeros(1, width)] * batch_size
        ids, feats, valid, answer = padded_batch([sequences[i] for i in picked], feats, target.dtype, target.device)
        hidden = draft.model(input_ids=ids, attention_mask=valid.long()).last_hidden_state  # [batch, width, dim]
        # the state at p-1 predicts the answer token at p
        return token_loss(hidden[:, :-1], 1, ids, feats, answer, teacher, soft=states is not None,
                          student=draft.lm_head.proj)

    target_id = target_identity(target, tokenizer)
    settings = {"objective": objective, "answers": sequences_key(sequences), "target": target_id,
                "head_tokens": key_of(head_ids.tolist()), "batch_size": batch_size, "seed": seed}
    with torch.enable_grad():
        losses = train(params, loss_fn, steps, work / "draft-model", lr=lr, progress=progress, desc="distill",
                       autocast=autocast_dtype(train_dtype, target.device), settings=settings)
    draft.eval()
    gate_info = {}
    if copy_gate:
        gate_losses = fit_copy_gate(draft, draft_gate_source(draft), sequences, work / "copy-gate", steps=gate_steps,
                                    seed=seed, progress=progress, device=target.device, settings={"target": target_id})
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
            write_atomic(out_dir / name, (work / "draft-model" / name).read_bytes())
        if gate_info and (work / "copy-gate" / name).is_file():
            write_atomic(out_dir / f"copy_gate_{name}", (work / "copy-gate" / name).read_bytes())
    return out_dir


def draft_gate_source(draft) -> GateSource:
    """The draft model's features and head, for :func:`~.copy_gate.fit_copy_gate`."""
    head = draft.lm_head
    return GateSource(
        features=lambda ids, valid, states: draft.model(input_ids=ids, attention_mask=valid.long()).last_hidden_state,
        logits=head.proj, head_ids=head.head_ids, hidden_size=draft.config.hidden_size)


__all__ = ["distill", "draft_gate_source"]
