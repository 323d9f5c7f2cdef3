"""What a request does to the target's distribution beyond the sampling settings: one interface,
folded over a round's logits in one place (:func:`process`) before acceptance.

A :class:`LogitsProcessor` takes the round's rows (:class:`RowState`: what a processor may read
of a request, no more), the round's :class:`~specdraft.verifier.Proposal` and the verify pass's
``logits # [batch, width + 1, vocab]``, and returns them processed (a new tensor where it changes
them: the runner's own are never written). In order:

1. :class:`LogitBias` (OpenAI's ``logit_bias``): each row's numbers added at every pass index;
2. :class:`GrammarMasks` (structured output): -inf wherever the row's grammar forbids the token
   a pass index predicts, from the row's matcher (see :mod:`specdraft.grammar`);
3. :class:`HoldStops` (``min_tokens``): EOS and the stop tokens -inf at every pass index that
   predicts one of the row's first ``min_tokens`` outputs, except where they are all that is
   left (a grammar that allows nothing but its end).

Each is what plain decoding does to its distribution at that position, applied at every
position a draft can reach, so acceptance (rejection sampling, greedy's argmax) stays exact: a
token a processor gives -inf has target probability 0, and its drafts are rejected. The
penalties (repetition, presence, frequency) are not processors: they are part of the sampling
pipeline (:func:`specdraft.sampling.logits_to_probs`), which drafters run on their own logits
too, so that a sampling drafter's distributions and the target's are processed alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np
import torch

from ..sampling import compute_dtype

if TYPE_CHECKING:  # pragma: no cover
    from ..grammar import GrammarMatcher
    from ..verifier import Proposal


@dataclass(frozen=True)
class RowState:
    """What the processors read of one row of a round."""

    #: output tokens so far (pass index ``j`` of a chain predicts output ``produced + j``)
    produced: int
    #: the first ``min_tokens`` outputs are never one of ``held`` (EOS unless ignore_eos, stop tokens)
    min_tokens: int
    held: tuple[int, ...]
    #: token id -> bias (None: none)
    logit_bias: "dict[int, float] | None"
    #: the row's place in its grammar (None: unconstrained)
    matcher: "GrammarMatcher | None"
    #: the tokens that end the row (EOS unless ignore_eos, and the stop tokens): a grammar allows
    #: them where it may end
    ends: frozenset


class LogitsProcessor(Protocol):
    def __call__(self, rows: Sequence[RowState], proposal: "Proposal", logits: torch.Tensor) -> torch.Tensor:
        """``logits # [batch, width + 1, vocab]`` processed (a new tensor where changed)."""


def process(processors: Sequence[LogitsProcessor], rows: Sequence[RowState], proposal: "Proposal",
            logits: torch.Tensor) -> torch.Tensor:
    """``logits`` through each of ``processors`` in turn."""
    for processor in processors:
        logits = processor(rows, proposal, logits)
    return logits


class LogitBias:
    """``logit_bias``: each biased row's numbers added to its logits at every pass index, before
    the sampling pipeline (penalties, temperature, filters), as plain decoding adds them at each
    step: the target's distribution itself changes, so acceptance stays exact. In float32 or
    wider (a bias is not rounded to bfloat16; the pipeline upcasts anyway)."""

    def __call__(self, rows, proposal, logits):
        biased = [(b, row.logit_bias) for b, row in enumerate(rows) if row.logit_bias]
        if not biased:
            return logits
        logits = logits.to(compute_dtype(logits.dtype), copy=True)
        for b, bias in biased:
            ids = torch.tensor(list(bias), device=logits.device)
            logits[b, :, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        return logits


class HoldStops:
    """``min_tokens``: the row's held tokens (EOS and the stop tokens) get logit -inf, so
    probability 0 (greedy: never the argmax), at every pass index whose token would be one of its
    first ``min_tokens`` outputs: index ``j`` of a chain predicts output ``produced + j``, a tree
    node at depth ``d`` output ``produced + d``. That is plain decoding's distribution with the
    same mask, so drafts of those tokens are rejected as any token the target gives 0 is. Where
    the held tokens are all that is left (a grammar that allows nothing but its end), they stay:
    the request ends there."""

    def __call__(self, rows, proposal, logits):
        short = [(b, row.min_tokens - row.produced, row.held) for b, row in enumerate(rows)
                 if row.min_tokens > row.produced and row.held]
        if not short:
            return logits
        logits = logits.clone()
        offsets = proposal.pass_depths  # [batch, width + 1]
        for b, left, held in short:
            banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            banned[torch.tensor(held, device=logits.device)] = True
            early = (offsets[b] < left).to(logits.device)  # [width + 1]
            held_back = logits[b].masked_fill(early[:, None] & banned, float("-inf"))
            alive = ~torch.isneginf(held_back).all(-1)  # [width + 1]: the hold left some token
            logits[b] = torch.where(alive[:, None], held_back, logits[b])
        return logits


class GrammarMasks:
    """Structured output: every constrained row's logits at -inf wherever its grammar forbids the
    token a pass index predicts (see :mod:`specdraft.grammar` for how a matcher fills the masks of
    a chain or a tree). A matcher that fails keeps its message in ``error`` and allows only the end
    tokens (the engine ends its request with the message). One bitmask buffer, reused round after
    round; rows without a grammar cost nothing."""

    def __init__(self) -> None:
        self._bits: np.ndarray | None = None  # [rows, words] uint32, grown when a round needs more

    def _buffer(self, rows: int, words: int) -> np.ndarray:
        if self._bits is None or self._bits.shape[0] < rows or self._bits.shape[1] != words:
            self._bits = np.zeros((max(rows, 8), words), dtype=np.uint32)
        return self._bits[:rows]

    def __call__(self, rows, proposal, logits):
        constrained = [b for b, row in enumerate(rows) if row.matcher is not None]
        if not constrained:
            return logits
        vocab, width, tree = logits.shape[-1], proposal.width, proposal.tree
        words = (max(rows[b].matcher.width for b in constrained) + 31) // 32
        bits = self._buffer(len(constrained) * (width + 1), words).reshape(len(constrained), width + 1, words)
        for k, b in enumerate(constrained):
            if tree is None:
                tokens, parents = proposal.token_ids[b, : int(proposal.lengths[b])].tolist(), None
            else:  # an invalid node (parent -2) is unreachable
                tokens = proposal.token_ids[b].tolist()
                parents = [p if ok else -2 for p, ok in zip(tree.parents[b].tolist(), tree.valid[b].tolist())]
            bits[k, len(tokens) + 1 :] = np.uint32(0xFFFFFFFF)  # a chain's padding: never read
            rows[b].matcher.fill(bits[k], tokens, parents, rows[b].ends)
        allowed = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[..., :vocab]  # [rows, width+1, vocab]
        forbidden = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        forbidden[constrained] = torch.from_numpy(allowed).to(logits.device) == 0
        return logits.masked_fill(forbidden, float("-inf"))


__all__ = ["GrammarMasks", "HoldStops", "LogitBias", "LogitsProcessor", "RowState", "process"]
