"""Fitting a learnt drafter's copy gate (:class:`~specdraft.drafters.common.copy_gate.CopyGate`).

The drafter is trained first and then frozen; the gate learns, from the target's own
answers, how far to trust the token that followed the last occurrence of the trailing
n-gram over the drafter's guess, by maximising the likelihood of the target's tokens under
the mixture. ``specdraft distill`` (the draft model) and ``specdraft train-heads`` (the
heads) both end with it; each supplies :class:`GateSource`, the feature its output head
reads before each token and the head itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..drafters.common.copy_gate import CopyGate, column_table
from .loop import seeded, step_generator, train, weights_digest


@dataclass
class GateSource:
    """Where a drafter's first guesses come from, teacher-forced over whole sequences.

    ``features(ids # [B, W], valid # [B, W], states # [B, W, H_t]) -> [B, W, H]``: entry ``p-1``
    is the feature from which the drafter guesses token ``p`` (entries it cannot fill are
    never read: answer tokens start at 2 or later). ``logits(features # [n, H]) -> [n, N]``
    the head's logits over ``head_ids`` (None: over every token id).
    """

    features: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    logits: Callable[[torch.Tensor], torch.Tensor]
    head_ids: torch.Tensor | None
    hidden_size: int


def gate_examples(source: GateSource, sequences: Sequence[dict], states: Sequence[torch.Tensor] | None = None,
                  device="cpu", dtype=torch.float32, batch_size: int = 8, min_ngram: int = CopyGate.MIN_NGRAM,
                  max_ngram: int = CopyGate.MAX_NGRAM) -> dict[str, torch.Tensor]:
    """What the copy gate learns from, at every answer position of ``sequences`` that has a copy
    candidate and where the drafter or the candidate can produce the target's token: the
    drafter's feature before it, the matched n-gram length, the drafter's log-probabilities of
    the candidate and of the target's token, and whether the candidate is the target's token."""
    from ..drafters.common.lookup import lookup
    from .batches import padded_batch

    head_ids = source.head_ids
    # token id -> column of the head's logits (-1: not in the head)
    slot = None if head_ids is None else column_table(head_ids, max(max(s["ids"]) for s in sequences) + 1)

    def column(tokens: torch.Tensor) -> torch.Tensor:
        return tokens if slot is None else slot[tokens]

    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("hidden", "match", "logp_copy", "logp_token", "hit")}
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            seqs = list(sequences[start : start + batch_size])
            feats = list(states[start : start + batch_size]) if states is not None else [torch.zeros(1, 1)] * len(seqs)
            ids, feats, valid, _ = padded_batch(seqs, feats, dtype, device)
            hidden = source.features(ids, valid, feats)
            for b, seq in enumerate(seqs):
                tokens = seq["ids"]
                found = [(p, *lookup(tokens[:p], 1, min_ngram, max_ngram)) for p in range(seq["prompt_len"], len(tokens))]
                found = [(p, c[0], n) for p, c, n in found if c]
                if not found:
                    continue
                pos = torch.tensor([p for p, _, _ in found], device=device)
                copy = torch.tensor([c for _, c, _ in found], device=device)
                h = hidden[b, pos - 1]  # [n, H]: the feature before position p guesses token p
                logp = source.logits(h).float().log_softmax(-1)  # [n, N]

                def logp_of(tokens: torch.Tensor) -> torch.Tensor:
                    col = column(tokens)
                    return torch.where(col >= 0, logp.gather(1, col.clamp(min=0)[:, None])[:, 0], -torch.inf)

                truth = ids[b, pos]
                parts["hidden"].append(h.float())
                parts["match"].append(torch.tensor([n for _, _, n in found], device=device))
                parts["logp_copy"].append(logp_of(copy).clamp(min=-30.0))
                parts["logp_token"].append(logp_of(truth).clamp(min=-30.0))
                parts["hit"].append((copy == truth).float())
    if not parts["hit"]:
        return {k: torch.zeros(0) for k in parts}
    out = {k: torch.cat(v) for k, v in parts.items()}
    useful = (out["hit"] > 0) | (out["logp_token"] > -30.0)  # else no gate changes the likelihood
    return {k: v[useful] for k, v in out.items()}


def mixture_nll(gate: CopyGate, ex: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean negative log-likelihood of the target's tokens under the copy mixture."""
    g = gate(ex["hidden"], ex["match"], ex["logp_copy"])
    likelihood = (1 - g) * ex["logp_token"].exp() + g * ex["hit"]
    return -(likelihood + 1e-9).log().mean()


def fit_copy_gate(owner: torch.nn.Module, source: GateSource, sequences: Sequence[dict], out_dir: Path,
                  states: Sequence[torch.Tensor] | None = None, steps: int = 300, batch: int = 4096, lr: float = 1e-2,
                  seed: int = 0, progress: bool = True, device="cpu", dtype=torch.float32,
                  settings: dict | None = None) -> list[float]:
    """Attach a :class:`CopyGate` to ``owner`` (as ``owner.copy_gate``) and fit it with the drafter
    frozen; returns the losses (none, and no gate attached, when no answer position has a copy
    candidate). ``out_dir`` holds the resumable checkpoint and the loss plot; it is resumed only
    for the same drafter weights, sequences, ``settings`` (what else the states depend on, such
    as the target) and options."""
    from .data import sequences_key

    ex = gate_examples(source, sequences, states, device=device, dtype=dtype)
    if not len(ex["hit"]):
        return []
    drafter = {n: t for n, t in owner.state_dict().items() if not n.startswith("copy_gate.")}
    if getattr(owner, "copy_gate", None) is None:
        with seeded(seed):
            owner.copy_gate = CopyGate(source.hidden_size).to(device=device, dtype=torch.float32)
    params = dict(owner.copy_gate.named_parameters())

    def loss_fn(step: int) -> torch.Tensor:
        pick = torch.randint(0, len(ex["hit"]), (batch,), generator=step_generator(seed, step)).to(device)
        return mixture_nll(owner.copy_gate, {k: v[pick] for k, v in ex.items()})

    settings = {**(settings or {}), "sequences": sequences_key(sequences), "drafter": weights_digest(drafter)[:16],
                "batch": batch, "seed": seed, "dtype": str(dtype)}
    with torch.enable_grad():
        return train(params, loss_fn, steps, out_dir, lr=lr, progress=progress, desc="copy gate", settings=settings)


__all__ = ["GateSource", "fit_copy_gate", "gate_examples", "mixture_nll"]
