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

import random
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..drafters.compact_draft import target_fingerprint
from ..drafters.heads.formats import save_heads
from ..drafters.heads.modules import KINDS, SharedHead, build_heads, causal_mask
from ..errors import ConfigError
from .data import chat_sequences, frequent_tokens, load_examples, target_answers, target_features
from .loop import train

#: EAGLE-1's weighting of its two losses: feature regression 1, token classification 0.1
EAGLE_CLASSIFICATION_WEIGHT = 0.1


def padded_batch(seqs: list[dict], states: list[torch.Tensor], dtype, device):
    """Pad a batch: ids ``[B, W]``, states ``[B, W, H]``, valid ``[B, W]`` and answer ``[B, W]`` masks."""
    width = max(len(s["ids"]) for s in seqs)
    batch = len(seqs)
    ids = torch.zeros((batch, width), dtype=torch.long)
    feats = torch.zeros((batch, width, states[0].shape[-1]), dtype=dtype)
    valid = torch.zeros((batch, width), dtype=torch.bool)
    answer = torch.zeros((batch, width), dtype=torch.bool)
    for b, (s, f) in enumerate(zip(seqs, states)):
        n = len(s["ids"])
        ids[b, :n] = torch.tensor(s["ids"])
        feats[b, :n] = f.to(dtype)
        valid[b, :n] = True
        answer[b, s["prompt_len"] : n] = True
    return ids.to(device), feats.to(device), valid.to(device), answer.to(device)


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
               noise: float = 0.0) -> torch.Tensor:
    """Teacher-forced training loss of one padded batch (see :func:`_batch`)."""
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
        return _eagle_loss(module, head, embeddings, ids, feats, valid, answer, soft, noise)
    raise ConfigError(f"unknown head kind {kind!r}; expected one of {', '.join(KINDS)}")


def _eagle_loss(module, head, embeddings, ids, feats, valid, answer, soft: bool, noise: float) -> torch.Tensor:
    """EAGLE's loss over two drafting steps.

    Step 1: pair ``t = (f_t, x_{t+1})`` guesses ``f_{t+1}`` (whose token is ``x_{t+2}``).
    Step 2, as at drafting time: the pair ``(guess of f_{t+1}, x_{t+2})`` guesses
    ``f_{t+2}``, attending to the true pairs before it and to itself only (one pass over the
    true pairs followed by the guessed ones, with a mask that says so). Without step 2 the
    layer never sees its own guesses as input and the second draft token is rarely right.
    Each step: smooth-L1 on the feature plus ``EAGLE_CLASSIFICATION_WEIGHT`` x cross-entropy.
    """
    batch, width = ids.shape
    n = width - 1
    true_in = feats[:, :-1]
    if noise:
        true_in = true_in + (torch.rand_like(true_in) * 2 - 1) * noise
    tokens = embeddings(ids[:, 1:])  # x_{t+1} for pair t
    positions = torch.arange(n, device=ids.device)
    guess = module(true_in, tokens, positions[None].expand(batch, n), causal_mask(n, feats.dtype, feats.device))

    def step_loss(guess_, first: int) -> torch.Tensor:
        """``guess_[:, i]`` guesses ``f_{i+first}``; its token is at position ``i+first+1``."""
        target = feats[:, first : first + guess_.shape[1]]
        keep = valid[:, first : first + guess_.shape[1]]
        regression = F.smooth_l1_loss(guess_[keep].float(), target[keep].float())
        token = token_loss(guess_[:, :-1], first + 1, ids, feats, answer, head, soft)
        return regression + EAGLE_CLASSIFICATION_WEIGHT * token

    loss = step_loss(guess, 1)
    if n < 3:
        return loss
    m = n - 1  # guessed pairs (guess of f_{t+1}, x_{t+2}) at positions t+1, t = 0..n-2
    both_f = torch.cat([true_in, guess[:, :-1]], dim=1)  # [B, n + m, H]
    both_x = torch.cat([tokens, embeddings(ids[:, 2:])], dim=1)
    both_pos = torch.cat([positions, positions[1:]])[None].expand(batch, n + m)
    mask = torch.full((n + m, n + m), torch.finfo(feats.dtype).min, dtype=feats.dtype, device=feats.device)
    mask[:n, :n] = causal_mask(n, feats.dtype, feats.device)[0, 0]
    rows = torch.arange(m, device=feats.device)
    sees_true = torch.arange(n, device=feats.device)[None] <= rows[:, None]  # guessed pair at t+1 sees true pairs <= t
    mask[n:, :n] = mask[n:, :n].masked_fill(sees_true, 0.0)
    mask[n + rows, n + rows] = 0.0  # and itself
    out = module(both_f, both_x, both_pos, mask[None, None])
    return loss + step_loss(out[:, n:], 2)


def train_heads(target, tokenizer, target_name: str, kind: str, prompt_files: Sequence[str], out_dir: str | Path,
                num_texts: int = 600, num_prompts: int = 600, self_prompts: int = 0, max_new_tokens: int = 128,
                steps: int = 700,
                batch_size: int = 8, lr: float = 1e-3, head_tokens: int | None = 8192, seed: int = 0,
                work_dir: str | Path | None = None, progress: bool = True, **head_config) -> Path:
    """Train heads of ``kind`` for ``target`` and save them in specdraft's format in ``out_dir``.

    ``work_dir`` (default ``out_dir/work``) caches the target's answers and hidden states,
    which do not depend on the kind: point several runs at one to compute them once.
    Checkpoints go to ``work_dir/<kind>``.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown head kind {kind!r}; expected one of {', '.join(KINDS)}")
    out_dir = Path(out_dir)
    work = Path(work_dir) if work_dir else out_dir / "work"
    (work / kind).mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    device = target.device

    texts = chat_sequences(tokenizer, load_examples(prompt_files, limit=num_texts, seed=seed))
    answers, answer_states = target_answers(target, tokenizer, prompt_files, work, num_prompts, self_prompts,
                                            max_new_tokens=max_new_tokens, seed=seed, progress=progress)
    text_states = target_features(target, texts, work / "text_states.safetensors", progress=progress,
                                  desc="target states (text)")
    data_seconds = time.perf_counter() - began

    specials = [t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if t is not None]
    head_ids = frequent_tokens(answers + texts, head_tokens, specials) if head_tokens else None
    lm_head = target.get_output_embeddings()
    head = SharedHead(lm_head, lm_head.weight.shape[0], head_ids).to(device=device, dtype=torch.float32)
    module = build_heads(kind, target.config.get_text_config(), **head_config).to(device=device, dtype=torch.float32)
    module.train()
    params = dict(module.named_parameters())
    embeddings = target.get_input_embeddings()
    with torch.no_grad():  # EAGLE's input noise is relative to the states' own scale
        noise = 0.1 * float(torch.cat(answer_states[:50]).float().std()) if kind == "eagle" else 0.0
    phase1 = round(steps * 5 / 7)
    rng = random.Random(seed)
    orders: dict[int, list[int]] = {1: [], 2: []}

    def loss_fn(step: int) -> torch.Tensor:
        phase = 1 if step < phase1 else 2
        seqs, states = (texts, text_states) if phase == 1 else (answers, answer_states)
        if len(orders[phase]) < batch_size:
            orders[phase] = list(range(len(seqs)))
            rng.shuffle(orders[phase])
        picked = [orders[phase].pop() for _ in range(batch_size)]
        ids, feats, valid, answer = padded_batch([seqs[i] for i in picked], [states[i] for i in picked], torch.float32,
                                           device)
        return heads_loss(kind, module, head, lambda t: embeddings(t).float(), ids, feats, valid, answer,
                          soft=phase == 2, noise=noise)

    with torch.enable_grad():
        losses = train(params, loss_fn, steps, work / kind, lr=lr, progress=progress, desc=f"train-heads ({kind})")
    module.eval()
    train_seconds = time.perf_counter() - began - data_seconds
    tail = losses[-20:]
    save_heads(module, head, out_dir, target_name, target_fingerprint(embeddings.weight), extra={
        "name": f"{target_name}-{kind}",
        "steps": steps, "phase1_steps": phase1, "batch_size": batch_size, "lr": lr,
        "text_sequences": len(texts), "answer_sequences": len(answers), "self_prompted": self_prompts,
        "final_loss": sum(tail) / max(1, len(tail)),
        "seconds": {"target_answers_and_states": round(data_seconds, 1), "training": round(train_seconds, 1),
                    "total": round(time.perf_counter() - began, 1)},
        "prompt_files": [Path(p).name for p in prompt_files],
    })
    for name in ("loss.png", "losses.json"):
        if (work / kind / name).is_file():
            (out_dir / name).write_bytes((work / kind / name).read_bytes())
    return out_dir


__all__ = ["heads_loss", "padded_batch", "token_loss", "train_heads"]
