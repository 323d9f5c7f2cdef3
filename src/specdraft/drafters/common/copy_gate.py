"""A learnt copy gate for learnt drafters (a pointer-generator for drafting).

A small drafter cannot copy from a long prompt the way its target does: on Spec-Bench
summarization the shipped 2-layer draft guesses 12% of the target's tokens, while the token
that followed the last occurrence of the trailing n-gram (prompt lookup's candidate) is
right 42% of the time. With a :class:`CopyGate` the drafter's distribution becomes a learnt
mixture of its own guess and that candidate. The draft model (``draft-model``) and the
heads (``eagle``, ``medusa``, ``mlp-speculator``) share this code: each gives
:class:`CopyDrafting` the feature its output head reads and the head's logits, and gets a
token (and, when sampling, the mixture it was drawn from) back.

The mixture is what is sampled and what is reported to the verifier, so rejection sampling
stays exact; greedy drafting takes the mixture's argmax. When sampling, the drafter's own
logits go through the whole pipeline (penalties, temperature, filters) before mixing, and the
mixture through the filters again (:func:`~specdraft.sampling.restrict`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ...sampling import TokenCounts, logits_to_probs, penalize, restrict, sample_rows


class CopyGate(torch.nn.Module):
    """How much of the draft's next-token probability goes to the copy candidate.

    The candidate is the token that followed the most recent earlier occurrence of the
    sequence's trailing n-gram (``min_ngram <= n <= max_ngram``, longest first: the
    prompt-lookup rule). The draft's distribution becomes

        q = (1 - g) p_draft + g onehot(candidate),   g = sigmoid(w.h + b[n] + a log p_draft(candidate))

    from the feature ``h`` the drafter's output head reads, the matched n-gram's length ``n``
    and how likely the drafter itself finds the candidate; ``g = 0`` where nothing matched.
    """

    MIN_NGRAM, MAX_NGRAM = 1, 3  # the default n-gram range (prompt-lookup's)

    def __init__(self, hidden: int, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM) -> None:
        super().__init__()
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.proj = torch.nn.Linear(hidden, 1)
        self.match = torch.nn.Embedding(max_ngram + 1, 1)
        self.agree = torch.nn.Parameter(torch.zeros(1))

    def spec(self) -> dict:
        """What a saved drafter's metadata records about its gate (see :meth:`from_spec`)."""
        return {"hidden": self.proj.in_features, "min_ngram": self.min_ngram, "max_ngram": self.max_ngram}

    @classmethod
    def from_spec(cls, spec: dict, hidden: int) -> "CopyGate":
        return cls(spec.get("hidden", hidden), spec["min_ngram"], spec["max_ngram"])

    def forward(self, hidden: torch.Tensor, match: torch.Tensor, logp_copy: torch.Tensor) -> torch.Tensor:
        """``hidden # [..., H]``, ``match # [...]`` (0: no candidate), ``logp_copy # [...]`` -> g ``# [...]``."""
        dtype = self.proj.weight.dtype
        z = (self.proj(hidden.to(dtype)).squeeze(-1) + self.match(match).squeeze(-1)
             + self.agree * logp_copy.to(dtype).clamp(min=-30.0))
        return torch.sigmoid(z.float()) * (match > 0)


#: Weights of a saved gate are stored under this prefix, in float32 (its logit adds terms of very different sizes).
STATE_PREFIX = "copy_gate."


def copy_mixture(probs: torch.Tensor, gate: torch.Tensor, copy_ids: torch.Tensor) -> torch.Tensor:
    """``(1 - gate) probs + gate onehot(copy_ids)``: ``probs # [B, V]``, ``gate, copy_ids # [B]``.

    Rows without a candidate must have ``gate == 0`` (their ``copy_ids`` entry is ignored).
    """
    gate = gate.to(probs.dtype)[:, None]
    mixed = probs * (1 - gate)
    return mixed.scatter_add_(1, copy_ids.clamp(min=0)[:, None], gate)


class DraftedRows(NamedTuple):
    """Each row's context followed by the tokens drafted so far this round, on the device:
    ``ids # [B, L]`` (padded past each row's length) and ``lengths # [B]``."""

    ids: torch.Tensor
    lengths: torch.Tensor

    def after(self, drafted: Sequence[torch.Tensor]) -> "DraftedRows":
        """These rows followed by ``drafted`` (``[B]`` tensors), written into the room past each
        row's length (``ids`` must have it: :func:`drafted_rows` leaves it); nothing read back."""
        if not drafted:
            return self
        tokens = torch.stack(list(drafted), dim=1).long()  # [B, m]
        at = self.lengths[:, None] + torch.arange(tokens.shape[1], device=self.ids.device)
        return DraftedRows(self.ids.scatter(1, at, tokens), self.lengths + tokens.shape[1])


def device_candidates(ids: torch.Tensor, lengths: torch.Tensor, min_ngram: int,
                      max_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.lookup.lookup`'s candidate (``k=1``) and n-gram length for every row at once, on the
    device (no copy to the host): ``ids # [B, L]`` each row's tokens, ``lengths # [B]`` how many are
    its own (the rest is padding). Returns ``(candidate # [B] (-1: none), n # [B] (0: none))``: for
    the longest ``n`` in ``max_ngram..min_ngram`` whose trailing n-gram occurs earlier, the token
    after its most recent earlier occurrence."""
    batch, width = ids.shape
    device = ids.device
    candidate = torch.full((batch,), -1, dtype=torch.long, device=device)
    match = torch.zeros(batch, dtype=torch.long, device=device)
    for n in range(max_ngram, min_ngram - 1, -1):
        if width <= n:
            continue
        tail = ids.gather(1, (lengths[:, None] - n + torch.arange(n, device=device)).clamp(min=0))  # [B, n]
        starts = torch.arange(width - n, device=device)  # windows of ids[:, :length - 1]: starts 0..length-1-n
        hits = (ids[:, : width - 1].unfold(1, n, 1) == tail[:, None, :]).all(-1)  # [B, width - n]
        hits &= starts[None, :] <= (lengths[:, None] - 1 - n)
        last = torch.where(hits, starts, -1).amax(1)  # [B] the most recent occurrence, -1: none
        found = (last >= 0) & (match == 0)
        after = ids.gather(1, (last + n).clamp(0, width - 1)[:, None])[:, 0]
        candidate = torch.where(found, after, candidate)
        match = torch.where(found, n, match)
    return candidate, match


def copy_candidates(rows, gate: CopyGate, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's copy candidate ``# [B]`` (-1: none) and matched n-gram length ``# [B]``; ``rows``
    a :class:`DraftedRows` (on the device, no copy to the host) or each row's tokens as lists."""
    if isinstance(rows, DraftedRows):
        return device_candidates(rows.ids, rows.lengths, gate.min_ngram, gate.max_ngram)
    from .lookup import lookup

    found = [lookup(r, 1, gate.min_ngram, gate.max_ngram) for r in rows]
    both = torch.tensor([[c[0] if c else -1 for c, _ in found], [n for _, n in found]], dtype=torch.long,
                        device=device)  # one copy to the device, not two
    return both[0], both[1]


def column_table(head_ids: torch.Tensor, size: int, missing: int = -1) -> torch.Tensor:
    """``[size]``: each token id's column in logits over ``head_ids`` (``missing`` where it has none)."""
    table = torch.full((max(size, int(head_ids.max()) + 1),), missing, dtype=torch.long, device=head_ids.device)
    table[head_ids] = torch.arange(head_ids.numel(), device=head_ids.device)
    return table


class CopyDrafting:
    """Draws tokens from the copy mixture of a drafter whose output head covers ``head_ids``.

    ``head_ids # [N]`` are the token ids of the head's logits (None: the head covers the whole
    vocabulary, column = id); ``vocab_size`` is the target's; ``services`` the target's
    (``TargetInfo.services``), for the C++ operator of greedy drafting on CPU.
    """

    def __init__(self, gate: CopyGate, head_ids: torch.Tensor | None, vocab_size: int, services=None) -> None:
        self.gate, self.head_ids, self.vocab_size = gate, head_ids, vocab_size
        #: greedy drafting's candidates and choice in one call on CPU (``specdraft_cpu::copy_choose``,
        #: lent by ``services.cpu_operator``), or None: torch's operators
        lend = getattr(services, "cpu_operator", None)
        self.operator = lend("copy_choose") if lend is not None else None
        # token id -> its column in the head's logits (-1: not in the head)
        self.slot = None if head_ids is None else column_table(head_ids, vocab_size)
        # the gate's weights as the operator takes them (the drafter's weights are loaded by now)
        self._weights = None if self.operator is None else (
            gate.proj.weight.detach().float().reshape(-1).contiguous(), float(gate.proj.bias.detach().float()),
            gate.match.weight.detach().float().reshape(-1).contiguous(), float(gate.agree.detach().float()))

    def gated(self, small: torch.Tensor, hidden: torch.Tensor, copy_ids: torch.Tensor, match: torch.Tensor):
        """``(logp # [..., N], gate, logp_copy # [...])`` for head logits ``small # [..., N]`` read
        from ``hidden # [..., H]``, with candidates ``copy_ids`` (-1: none) of n-gram length ``match``."""
        slot = copy_ids.clamp(min=0) if self.slot is None else self.slot[copy_ids.clamp(min=0)]  # -1: not in the head
        logp = small.float().log_softmax(-1)
        logp_copy = torch.where(slot >= 0, logp.gather(-1, slot.clamp(min=0)[..., None])[..., 0], -torch.inf)
        return logp, self.gate(hidden, match, logp_copy), logp_copy

    def argmax(self, small: torch.Tensor, hidden: torch.Tensor, copy_ids: torch.Tensor, match: torch.Tensor):
        """The mixture's most likely token ``# [...]`` (greedy drafting); shapes as in :meth:`gated`."""
        return self.choose(small, hidden, copy_ids, match)[0]

    def choose(self, small: torch.Tensor, hidden: torch.Tensor, copy_ids: torch.Tensor, match: torch.Tensor):
        """The mixture's most likely token and its probability under the mixture, both ``# [...]``.

        The candidate wins when ``g + (1 - g) p(candidate) >= (1 - g) max p``. Computed from one
        softmax, without building the mixture: greedy drafting runs this once per drafted
        token, where each operation launched costs more than its arithmetic.
        """
        slot = copy_ids.clamp(min=0) if self.slot is None else self.slot[copy_ids.clamp(min=0)]  # -1: not in the head
        probs = small.float().softmax(-1)
        top_p, top_i = probs.max(-1)
        p_copy = probs.gather(-1, slot.clamp(min=0)[..., None])[..., 0] * (slot >= 0)
        gate = self.gate(hidden, match, p_copy.log())  # 0 where nothing matched
        copy_weight, top_weight = gate + (1 - gate) * p_copy, (1 - gate) * top_p
        best = top_i if self.head_ids is None else self.head_ids[top_i]
        token = torch.where((gate > 0) & (copy_weight >= top_weight), copy_ids, best)
        return token, torch.maximum(copy_weight, top_weight)

    def _native(self, small: torch.Tensor) -> bool:
        """Whether :meth:`_native_choose` serves: an operator lent, 2-D logits on a CPU."""
        return self.operator is not None and small.device.type == "cpu" and small.dim() == 2 and small.dtype in (
            torch.float32, torch.bfloat16, torch.float16)

    def _native_choose(self, small: torch.Tensor, hidden: torch.Tensor, rows: DraftedRows):
        """:func:`device_candidates` and :meth:`choose` as one C++ operator (``specdraft_cpu::copy_choose``):
        the same rule in float32, without some fifty small operators per drafted token."""
        proj, bias, match, agree = self._weights
        return self.operator(small, hidden, rows.ids, rows.lengths, self.slot, self.head_ids, proj, bias, match, agree,
                             self.gate.min_ngram, self.gate.max_ngram)

    def full_logits(self, small: torch.Tensor) -> torch.Tensor:
        """The head's logits ``small # [B, N]`` over the target's whole vocabulary (float32; the
        lowest float outside the head's tokens).  # [B, vocab]"""
        full = small.float()
        if self.head_ids is not None:
            full = torch.full((small.shape[0], self.vocab_size), torch.finfo(torch.float32).min, device=small.device)
            full.index_copy_(1, self.head_ids, small.float())
        return full[:, : self.vocab_size]

    def draw(self, small: torch.Tensor, hidden: torch.Tensor, rows: Sequence[Sequence[int]], sampling, generator,
             counts: TokenCounts | None = None):
        """One token per row: ``(tokens # [B], probs # [B, vocab] | None, confidence # [B] | None)``,
        like :func:`~specdraft.sampling.draw` plus, when greedy, the mixture's probability of the token.

        ``small # [B, N]`` the head's logits, ``hidden # [B, H]`` the feature it read, ``rows``
        each row's tokens so far (context plus what was drafted this round: :func:`drafted_rows`), ``counts`` the
        penalties' context at this position (the head's distribution is penalized before mixing).
        """
        greedy = sampling.greedy and not sampling.penalized
        if greedy and isinstance(rows, DraftedRows) and self._native(small):  # candidates and choice in one call
            token, confidence = self._native_choose(small, hidden, rows)
            return token, None, confidence
        copy_ids, match = copy_candidates(rows, self.gate, small.device)
        if greedy:
            token, confidence = self.choose(small, hidden, copy_ids, match)
            return token, None, confidence
        gate = self.gated(small, hidden, copy_ids, match)[1]
        full = self.full_logits(small)
        if sampling.greedy:  # with penalties: the mixture of the penalized distribution, its argmax
            mixed = copy_mixture(penalize(full, sampling, counts).softmax(-1), gate, copy_ids)
            confidence, token = mixed.max(-1)
            return token, None, confidence
        mixed = restrict(copy_mixture(logits_to_probs(full, sampling, counts), gate, copy_ids), sampling)
        return sample_rows(mixed, generator), mixed, None


def copy_table(ids: torch.Tensor, gate: CopyGate) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced candidates over whole sequences ``ids # [B, W]``: ``(copy_ids, match) # [B, W]``,
    entry ``p`` the candidate for token ``p`` (from tokens ``0..p-1``), -1 / 0 where none."""
    rows = ids.tolist()
    copy_ids, match = torch.full_like(ids, -1), torch.zeros_like(ids)
    for p in range(1, ids.shape[1]):
        copy_ids[:, p], match[:, p] = copy_candidates([r[:p] for r in rows], gate, ids.device)
    return copy_ids, match


def drafted_rows(ctx, drafted: Sequence[torch.Tensor], device, room: int) -> DraftedRows:
    """Each row of ``ctx`` (a :class:`~specdraft.types.DraftContext`): its context followed by the
    tokens drafted so far this round (``drafted``: ``[B]`` tensors on ``device``, at most ``room``
    of them), kept on the device so a drafting step copies nothing to the host (the round's one
    copy is the verifier's). The contexts go to the device once per round (kept on ``ctx``),
    zero-padded to a power of two (at least 64) with room for ``room`` drafted tokens: a whole
    chain's CUDA graph is captured for a few widths, not one per context length."""
    room_then, base = getattr(ctx, "_copy_rows", (-1, None))
    if base is None or base.ids.device != torch.device(device) or room_then < room:
        rows = ctx.token_ids
        width = max(64, 1 << (max((len(r) for r in rows), default=0) + room - 1).bit_length())
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        base = DraftedRows(ids.to(device), torch.tensor([len(r) for r in rows], dtype=torch.long).to(device))
        ctx._copy_rows = (room, base)
    return base.after(drafted)


__all__ = ["CopyDrafting", "CopyGate", "DraftedRows", "column_table", "copy_candidates", "copy_mixture", "copy_table",
           "device_candidates", "drafted_rows"]
