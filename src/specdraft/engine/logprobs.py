"""The target's log-probabilities of a round's committed tokens, for the requests that ask for them.

A row's committed tokens came from the verify pass's logits at known pass indices: a chain's
``n`` accepted drafts and its next token from indices ``0..n`` (index ``j`` predicts the token
after ``d_j``), a tree's from index 0 and then ``p + 1`` for each accepted node ``p`` of its path.
The logits at those indices are the ones plain decoding computes at the same positions (bit for
bit where the runner's passes are row- and width-invariant, as in float32 and bfloat16 on CPU; a
tree node sees exactly its ancestors), and the penalty context there is the sequence before
the round plus the committed tokens before it (the drafts before an index on the accepted path
are those tokens), which is plain decoding's context. So the log-probabilities below are plain
decoding's, whatever was drafted.

Two modes, as vLLM's ``--logprobs-mode``:

``processed`` (the default)
    the distribution the token was drawn from: :func:`~specdraft.sampling.process_logits` (the
    penalties with each index's own counts, temperature, top-k, top-p, min-p; -inf for a
    filtered token) of the logits after the engine's masks (``min_tokens``'s held-back tokens,
    a grammar's), then log-softmax; a greedy row (temperature 0): the penalized logits, no
    temperature and no filters (what its argmax is taken of), as vLLM does.
``raw``
    log-softmax of the model's own logits, before any mask or processing.

Arithmetic in float32 or wider (:func:`~specdraft.sampling.compute_dtype`). Rows that did not
ask cost nothing; those that did are moved to the host in one copy.
"""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from ..sampling import SamplingParams, TokenCounts, compute_dtype, penalize, process_logits
from ..types import LOGPROBS_MODES, MAX_LOGPROBS, TokenLogprob
from ..verifier import Outcome


def processed_logprobs(logits: torch.Tensor, params: SamplingParams,
                       counts: TokenCounts | None = None) -> torch.Tensor:
    """``logits # [m, vocab]`` (the engine's masks applied) -> the log of the distribution the
    token at each position is drawn from ``# [m, vocab]`` (see the module docstring); ``counts``:
    each position's penalty context ``# [m, vocab]`` (None: no penalty)."""
    if params.greedy:
        return penalize(logits, params, counts).log_softmax(-1)
    return process_logits(logits, params, counts).log_softmax(-1)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax of the model's logits ``# [m, vocab]`` in float32 or wider."""
    return logits.to(compute_dtype(logits.dtype)).log_softmax(-1)


def _counts_at(counts: TokenCounts, b: int, tokens: torch.Tensor) -> TokenCounts:
    """Row ``b``'s penalty context where each of its committed ``tokens # [m]`` was chosen: the
    sequence before the round plus the committed tokens before it  # [m, vocab]. (The drafts before
    a pass index on the accepted path, a tree node's ancestors, are exactly those tokens: the
    context acceptance used there, and plain decoding's.)"""
    along = counts.select(slice(b, b + 1)).along(tokens[None, :-1])  # [1, m, vocab]
    return TokenCounts(along.in_context[0], along.in_output[0])


def round_logprobs(batch: Seq, outcome: Outcome, raw_logits: torch.Tensor, logits: torch.Tensor,
                   counts: TokenCounts | None) -> dict[int, list[TokenLogprob]]:
    """Each asking row's :class:`~specdraft.types.TokenLogprob` per committed token (row -> list,
    in the order of ``outcome.committed(b)``; empty when no row asked).

    ``batch[b]`` is row ``b``'s :class:`~specdraft.engine.sequence.Sequence` (its ``logprobs``,
    ``logprobs_mode`` and ``sampling``); ``raw_logits`` the pass's logits as the model gave them
    and ``logits`` after the engine's masks, both ``# [batch, width + 1, vocab]``; ``counts`` the
    rows' penalty context before the draft (None: no row has a penalty)."""
    rows = [b for b, s in enumerate(batch) if s.logprobs is not None]
    if not rows:
        return {}
    device = logits.device
    widest = max(batch[b].logprobs for b in rows)
    pieces = []
    for b in rows:
        s = batch[b]
        at = torch.tensor(outcome.pass_indices(b), device=device)  # [m]
        tokens = torch.tensor(outcome.committed(b), device=device)  # [m]
        if s.logprobs_mode == "raw":
            lp = raw_logprobs(raw_logits[b, at])
        else:
            penalized = counts is not None and s.sampling.penalized
            lp = processed_logprobs(logits[b, at], s.sampling, _counts_at(counts, b, tokens) if penalized else None)
        piece = [lp.gather(1, tokens[:, None])]  # [m, 1]
        if s.logprobs:
            top = lp.topk(s.logprobs, dim=-1)
            piece += [top.values, top.indices.to(lp.dtype)]  # [m, N] each (ids exact in float32 up to 2**24)
        piece = torch.cat(piece, 1).double()
        pieces.append(torch.nn.functional.pad(piece, (0, 2 * widest + 1 - piece.shape[1])))
    host = torch.cat(pieces).tolist()  # the one device-to-host copy: [sum of m, 1 + 2 * widest]
    out, start = {}, 0
    for b in rows:
        n, tokens = batch[b].logprobs, outcome.committed(b)
        entries = []
        for token, row in zip(tokens, host[start : start + len(tokens)]):
            top = sorted(zip((int(i) for i in row[1 + n : 1 + 2 * n]), row[1 : 1 + n]), key=lambda t: (-t[1], t[0]))
            entries.append(TokenLogprob(token_id=token, logprob=row[0], top=tuple(top)))
        out[b] = entries
        start += len(tokens)
    return out


__all__ = ["LOGPROBS_MODES", "MAX_LOGPROBS", "processed_logprobs", "raw_logprobs", "round_logprobs"]
