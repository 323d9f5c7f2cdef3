"""References written without specdraft's code: what plain decoding gives.

Everything here reads the model's raw logits (``model(ids).logits``, in the model's own dtype,
then float64) and processes them with transformers' own logits processors and OpenAI's formula
for the presence and frequency penalties. None of specdraft's sampling, engine or runner code
is used, so a bug that specdraft's target and draft sides share (a temperature applied twice,
a top-p off by one token) makes the speculative output differ from these references.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


def plain_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers' own greedy ``generate`` (no specdraft code involved)."""
    import torch

    out = model.generate(
        torch.tensor([list(prompt)], device=model.device), max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def naive_penalized_greedy(model, prompt: Sequence[int], max_new_tokens: int, params) -> list[int]:
    """Reference for greedy decoding with penalties, written out token by token with no
    specdraft code: a full forward per step, then transformers' repetition penalty and
    OpenAI's presence and frequency penalties on that step's logits, then the argmax."""
    import torch

    tokens, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([tokens], device=model.device)).logits[0, -1].double().tolist()
            for t in set(tokens):
                logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * params.repetition_penalty
            for t, c in Counter(out).items():
                logits[t] -= params.presence_penalty + params.frequency_penalty * c
            best = max(range(len(logits)), key=lambda i: (logits[i], -i))
            tokens.append(best)
            out.append(best)
    return out


def reference_probs(logits, context, generated, params):
    """The sampling distribution of plain decoding, from transformers' processors in generate's
    order (repetition penalty, then temperature, top-k, top-p, min-p) with OpenAI's presence and
    frequency penalties (``logit -= presence * (count > 0) + frequency * count`` over generated
    tokens) after the repetition penalty, all in float64.

    ``logits # [rows, vocab]`` (any dtype), ``context # [rows, length]`` (prompt and output so
    far), ``generated # [rows, n]`` (the output so far, a suffix of ``context``). Returns
    ``# [rows, vocab]`` float64 probabilities.
    """
    import torch
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    scores = logits.double().clone()
    context = context.to(scores.device)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(context, scores)
    if generated.shape[-1] and (params.presence_penalty or params.frequency_penalty):
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, generated.to(scores.device), torch.ones_like(generated, dtype=scores.dtype))
        scores = scores - params.presence_penalty * (counts > 0) - params.frequency_penalty * counts
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(context, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(context, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(context, scores)
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(context, scores)
    return scores.softmax(-1)


@dataclass(frozen=True)
class Enumerated:
    """Every sequence of the first ``steps`` tokens that plain sampling can emit, with its
    probability: ``sequences # [m, steps]``, ``probs # [m]`` float64 (sums to 1)."""

    sequences: "torch.Tensor"
    probs: "torch.Tensor"
    vocab: int

    @property
    def steps(self) -> int:
        return self.sequences.shape[1]

    def marginal(self, position: int):
        """P(token at ``position``)  # [vocab]"""
        import torch

        return torch.zeros(self.vocab, dtype=torch.float64).index_add_(0, self.sequences[:, position], self.probs)

    def pair(self, first: int, second: int):
        """P(tokens at ``first`` and ``second``), flattened  # [vocab * vocab]"""
        import torch

        cells = self.sequences[:, first] * self.vocab + self.sequences[:, second]
        return torch.zeros(self.vocab**2, dtype=torch.float64).index_add_(0, cells, self.probs)

    def dense(self):
        """The joint as a ``[vocab] * steps`` tensor (small vocabularies and few steps only)."""
        import torch

        joint = torch.zeros([self.vocab] * self.steps, dtype=torch.float64)
        joint[tuple(self.sequences.T)] = self.probs
        return joint


def enumerate_plain_sampling(model, prompt: Sequence[int], params, steps: int, max_sequences: int = 1_000_000,
                             chunk: int = 4096, adjust=None) -> Enumerated:
    """P(first ``steps`` tokens) under plain sampling from ``model``, by enumeration of every
    prefix the filters keep (:func:`reference_probs` on the model's raw logits, level by level,
    one batched forward per ``chunk`` prefixes). ``adjust(level, logits)``, if given, returns the
    logits the processors see at output position ``level`` (a mask, a bias: what a request adds
    to plain decoding). Raises ``ValueError`` when more than ``max_sequences`` sequences have
    non-zero probability: use top-k, fewer steps or a smaller vocabulary."""
    import torch

    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.device
    prefixes = torch.zeros((1, 0), dtype=torch.long)  # [m, level]
    probs = torch.ones(1, dtype=torch.float64)  # [m]
    base = torch.tensor(list(prompt), dtype=torch.long)
    with torch.no_grad():
        for level in range(steps):
            rows = []
            for start in range(0, prefixes.shape[0], chunk):
                part = prefixes[start : start + chunk]
                context = torch.cat([base.expand(part.shape[0], -1), part], 1)
                logits = model(context.to(device)).logits[:, -1].cpu()
                if adjust is not None:
                    logits = adjust(level, logits)
                rows.append(reference_probs(logits, context, part, params))
            step = torch.cat(rows) * probs[:, None]  # [m, vocab]: P(prefix, next token)
            keep = step > 0
            if int(keep.sum()) > max_sequences:
                raise ValueError(f"{int(keep.sum())} sequences of {level + 1} tokens have non-zero probability "
                                 f"(at most {max_sequences}): use top-k, fewer steps or a smaller vocabulary")
            parent, token = keep.nonzero(as_tuple=True)
            prefixes = torch.cat([prefixes[parent], token[:, None]], 1)
            probs = step[parent, token]
    return Enumerated(prefixes, probs / probs.sum(), vocab)


def exact_joint_distribution(model, prompt: Sequence[int], params, steps: int = 2):
    """P(first ``steps`` tokens) under plain sampling from ``model`` as a dense ``[vocab] * steps``
    tensor (:func:`enumerate_plain_sampling`; practical for vocabularies of a few dozen tokens)."""
    return enumerate_plain_sampling(model, prompt, params, steps).dense()
