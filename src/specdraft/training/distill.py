"""``specdraft distill``: build a compact draft for a target from the target's own outputs.

1. The target answers training prompts (greedy, plus a share of sampled answers).
2. The draft's output head keeps the ``head_tokens`` most frequent tokens of those answers.
3. The draft (``layers`` decoder layers initialised from the target's first layers, the
   target's embeddings shared and frozen) learns to predict each next answer token
   (cross-entropy over the head's tokens; tokens outside the head are not trained on).
4. It is saved in specdraft's compact format, loadable with ``--drafter draft-model
   --drafter-option model=DIR``.

Every stage is resumable: answers are cached in ``DIR/work/sequences.json`` and training
checkpoints in ``DIR/work/checkpoint``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Sequence

import torch

from ..drafters.compact_draft import build_compact_draft, save_compact_draft, target_fingerprint
from .data import frequent_tokens, target_generations
from .loop import train


def distill(target, tokenizer, target_name: str, prompt_files: Sequence[str], out_dir: str | Path,
            num_prompts: int = 600, sampled_fraction: float = 0.25, max_new_tokens: int = 128, layers: int = 2,
            head_tokens: int = 8192, steps: int = 300, batch_size: int = 8, lr: float = 5e-4,
            gen_batch_size: int = 16, seed: int = 0, progress: bool = True) -> Path:
    out_dir = Path(out_dir)
    work = out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()

    sequences = target_generations(target, tokenizer, prompt_files, work / "sequences.json", num_prompts,
                                   sampled_fraction, max_new_tokens, gen_batch_size, seed, progress)
    gen_seconds = time.perf_counter() - began

    specials = [t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if t is not None]
    head_ids = frequent_tokens(sequences, head_tokens, specials).to(target.device)
    draft = build_compact_draft(target, layers, head_ids)
    draft.train()
    for p in draft.model.embed_tokens.parameters():
        p.requires_grad_(False)
    params = {n: p for n, p in draft.named_parameters() if p.requires_grad}
    to_head = torch.full((draft.config.vocab_size,), -100, dtype=torch.long, device=target.device)
    to_head[head_ids] = torch.arange(head_ids.numel(), device=target.device)
    rng = random.Random(seed)
    order: list[int] = []

    def loss_fn(step: int) -> torch.Tensor:
        nonlocal order
        if len(order) < batch_size:
            order = list(range(len(sequences)))
            rng.shuffle(order)
        batch = [sequences[order.pop()] for _ in range(batch_size)]
        width = max(len(s["ids"]) for s in batch)
        ids = torch.zeros((batch_size, width), dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for b, s in enumerate(batch):
            n = len(s["ids"])
            ids[b, :n] = torch.tensor(s["ids"])
            mask[b, :n] = 1
            answer = torch.tensor(s["ids"][s["prompt_len"]:])
            labels[b, s["prompt_len"] - 1 : n - 1] = to_head.cpu()[answer]  # predict each answer token
        ids, labels, mask = ids.to(target.device), labels.to(target.device), mask.to(target.device)
        hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [batch, width, dim]
        logits = draft.lm_head.proj(hidden)  # [batch, width, head_tokens]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    with torch.enable_grad():
        losses = train(params, loss_fn, steps, work, lr=lr, progress=progress, desc="distill")
    draft.eval()
    train_tokens = sum(len(s["ids"]) - s["prompt_len"] for s in sequences)
    save_compact_draft(draft, out_dir, target_name, target_fingerprint(target.get_input_embeddings().weight), extra={
        "name": f"{target_name}-draft-{layers}L",
        "layers": layers, "prompts": len(sequences), "answer_tokens": train_tokens, "steps": steps,
        "batch_size": batch_size, "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "generation_seconds": round(gen_seconds, 1), "total_seconds": round(time.perf_counter() - began, 1),
        "prompt_files": [Path(p).name for p in prompt_files],
    })
    for name in ("loss.png", "losses.json"):
        if (work / name).is_file():
            (out_dir / name).write_bytes((work / name).read_bytes())
    return out_dir


__all__ = ["distill"]
