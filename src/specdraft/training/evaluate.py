"""Held-out acceptance: how often a learnt drafter's greedy guesses would be accepted.

Measured offline on greedy answers of the target that training did not see, which is
exactly what greedy verification tests: a chain that starts after position ``j`` (the
target's newest state ``f_j``, its newest token ``x_{j+1}``) guesses ``x_{j+2}, x_{j+3}, ...``
and its guess at depth ``s`` counts only if every guess before it was right. Because the
answers are the target's own greedy tokens, feeding the true tokens is feeding the guesses
whenever the guesses were right, so one teacher-forced pass per depth gives every chain.

``acceptance[s-1]`` is P(guesses ``1..s`` all right): the share of drafts of at least ``s``
tokens whose ``s``-th token is accepted, which is what ``specdraft bench`` and ``--stats``
report as acceptance by position. Its ratios are the conditional rates the verifier's
draft-length policy weighs (P(guess ``s`` right | guesses before it right)).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

#: ``predict(ids # [B, W], feats # [B, W, H]) -> [guesses of depth 1, 2, ...]``, depth ``s``
#: a ``[B, W - s - 1]`` tensor of token ids whose entry ``j`` guesses ``x_{j+s+1}``
Predictor = Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]


def held_out_acceptance(predict: Predictor, sequences: Sequence[dict], states: Sequence[torch.Tensor] | None,
                        depth: int, batch_size: int = 8, dtype=torch.float32, device="cpu") -> list[float]:
    """Acceptance by draft position (see the module docstring) over ``sequences``' answers.

    Chains are counted where the target's answer is long enough to test them: depth ``s``
    conditions on the chains that reach it, and the rates are chained from there.
    """
    from .batches import padded_batch

    right = [0] * (depth + 1)  # right[s]: chains whose first s guesses were all right
    tested = [0] * (depth + 1)  # tested[s]: chains whose guess s was tested
    width = states[0].shape[-1] if states else 1
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            seqs = list(sequences[start : start + batch_size])
            feats = list(states[start : start + batch_size]) if states else [torch.zeros(len(s["ids"]), width) for s in seqs]
            ids, feats, valid, _ = padded_batch(seqs, feats, dtype, device)
            W = ids.shape[1]
            lengths = valid.sum(1)
            chain = torch.ones((ids.shape[0], max(W - 2, 0)), dtype=torch.bool, device=ids.device)  # j = 0..W-3
            starts = torch.arange(chain.shape[1], device=ids.device)
            first = torch.tensor([s["prompt_len"] - 2 for s in seqs], device=ids.device)  # chains after prefill
            for s, guess in enumerate(predict(ids, feats)[:depth], 1):
                n = W - s - 1  # chains whose guess s lies inside the padded width
                if n <= 0:
                    break
                ok = guess[:, :n] == ids[:, s + 1 : s + 1 + n]
                inside = (starts[None, :n] >= first[:, None]) & (starts[None, :n] + s + 1 < lengths[:, None])
                alive = chain[:, :n] & inside
                tested[s] += int(alive.sum())
                chain = chain[:, :n] & ok
                right[s] += int((chain & inside).sum())
    acceptance, survive = [], 1.0
    for s in range(1, depth + 1):
        survive *= right[s] / tested[s] if tested[s] else 0.0
        acceptance.append(survive)
    return acceptance


class _Chooser:
    """Greedy choice from a head's logits, through the drafter's copy gate when it has one
    (as the drafter chooses); ``ids`` the batch's tokens, for the gate's candidates."""

    def __init__(self, head_ids: torch.Tensor | None, gate, vocab_size: int, ids: torch.Tensor) -> None:
        from ..drafters.common.copy_gate import CopyDrafting, copy_table

        self.head_ids = head_ids
        self.copier = CopyDrafting(gate, head_ids, vocab_size) if gate is not None else None
        self.table = copy_table(ids, gate) if gate is not None else None

    def __call__(self, small: torch.Tensor, feature: torch.Tensor, first: int) -> torch.Tensor:
        """``small # [B, n, N]`` logits read from ``feature # [B, n, H]``, entry ``j`` guessing token ``first + j``."""
        if self.copier is None:
            best = small.argmax(-1)
            return best if self.head_ids is None else self.head_ids[best]
        n = small.shape[1]
        copy_ids, match = (t[:, first : first + n] for t in self.table)
        return self.copier.argmax(small, feature, copy_ids, match)


def heads_predictor(kind: str, module, head, embeddings, depth: int) -> Predictor:
    """Greedy guesses of trained heads of ``kind`` (``head``: their :class:`SharedHead`; EAGLE-3's
    own norm and LM head over its draft vocabulary, as :func:`~specdraft.drafters.heads.formats.load_heads`
    gives it, its states the aux layers' side by side), through their copy gate when they have one."""
    from .batches import eagle3_features, eagle_unroll

    def predict(ids: torch.Tensor, feats: torch.Tensor) -> list[torch.Tensor]:
        W = ids.shape[1]
        gate = getattr(module, "copy_gate", None)
        own = kind == "medusa" and module.own_heads is not None  # a published checkpoint's own LM heads
        choose = _Chooser(head.head_ids, None if own else gate, head.vocab_size, ids)
        out = []
        if kind in ("eagle", "eagle3"):
            first = eagle3_features(module, feats) if kind == "eagle3" else feats
            for s, guess in enumerate(eagle_unroll(module, embeddings, ids, first, depth), 1):
                out.append(choose(head.small(guess[:, :-1]), guess[:, :-1], s + 1))
        elif kind == "medusa":
            for s in range(1, min(depth, module.num_heads) + 1):
                feature = module.blocks[s - 1](feats[:, : W - s - 1])
                if own:
                    out.append(module.own_heads[s - 1](feature).argmax(-1))
                else:
                    out.append(choose(head.small(feature), feature, s + 1))
        else:  # mlp-speculator: stage s reads stage s-1's state and the token before its guess
            state = feats[:, : W - 2]
            for s in range(1, min(depth, module.num_stages) + 1):
                n = W - s - 1
                state, feature = module.stage(s - 1, state[:, :n], embeddings(ids[:, s : s + n]))
                out.append(choose(head.small(feature), feature, s + 1))
        return out

    return predict


def draft_model_predictor(draft, depth: int) -> Predictor:
    """Greedy guesses of an autoregressive draft model: depth ``s`` of chain ``j`` is its
    prediction after ``x_{j+s}`` (through its copy gate, when it has one)."""

    def predict(ids: torch.Tensor, feats: torch.Tensor) -> list[torch.Tensor]:
        W = ids.shape[1]
        head = draft.lm_head
        choose = _Chooser(head.head_ids, getattr(draft, "copy_gate", None), draft.config.vocab_size, ids)
        hidden = draft.model(input_ids=ids).last_hidden_state  # [B, W, dim]
        with head.unscattered():
            best = choose(head(hidden)[:, : W - 1], hidden[:, : W - 1], 1)  # [B, W-1]: entry p guesses x_{p+1}
        return [best[:, s:] for s in range(1, depth + 1)]

    return predict


def split_held_out(sequences: Sequence[dict], every: int = 20) -> tuple[list[int], list[int]]:
    """``(train, held_out)`` indices: every ``every``-th greedy answer is held out."""
    greedy = [i for i, s in enumerate(sequences) if s.get("greedy", False)]
    held = set(greedy[every - 1 :: every])
    return [i for i in range(len(sequences)) if i not in held], sorted(held)
