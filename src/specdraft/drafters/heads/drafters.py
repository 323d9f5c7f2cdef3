"""``medusa``, ``eagle`` and ``mlp-speculator``: drafters that read the target's hidden states.

Each sets ``needs_hidden_states``, so the verifier hands it the target's last-layer states
of every committed position (see :meth:`Drafter.on_hidden_states`). With the tokens of
``ctx`` that is all a head needs: at ``propose`` time the newest state is ``f_{L-2}`` (``L``
tokens in the row), whose own next token ``x_{L-1}`` the target already chose, so the
heads guess ``x_L, x_{L+1}, ...``.

Draft distributions are each head's logits through ``logits_to_probs`` (the target's
processing), so sampling stays exact; greedy drafting takes the argmax. Heads with a copy
gate (:mod:`specdraft.drafters.copy_gate`) draw from, and report, the gated mixture instead.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ...errors import ConfigError
from ...types import Draft, DraftContext, TargetInfo
from ..base import DraftChain, Drafter, HeadOptions, draw_scored, layer_runner
from ..copy_gate import CopyDrafting, drafted_rows


class HeadDrafter(Drafter):
    """Shared loading and hidden-state bookkeeping of the head drafters."""

    kind: ClassVar[str] = ""
    needs_hidden_states = True
    Options = HeadOptions

    def __init__(self, options: HeadOptions, target: TargetInfo) -> None:
        from .formats import FORMAT_FILE, load_heads
        from ..shipped import find_shipped

        path = options.heads or find_shipped(target, FORMAT_FILE, kind=self.kind)
        if path is None:
            raise ConfigError(
                f"{self.kind} has no shipped heads for target {target.name!r}: pass --drafter-option heads=DIR "
                f"(a folder from `specdraft train-heads --kind {self.kind}`, or a published checkpoint)"
            )
        self.module, self.head, self.meta = load_heads(path, target, self.kind)
        gate = getattr(self.module, "copy_gate", None) if options.copy_gate else None
        self.copier = CopyDrafting(gate, self.head.head_ids, target.vocab_size) if gate is not None else None
        super().__init__(options, target)

    def reset(self) -> None:
        self._last: torch.Tensor | None = None  # [batch, H]: each row's newest target state
        self._has: list[bool] = []  # whether row b has any state yet (a 1-token prompt has none)

    def on_hidden_states(self, ctx: DraftContext, hidden_states: list[torch.Tensor]) -> None:
        if self._last is None or self._last.shape[0] != len(hidden_states):
            self._last = torch.zeros((len(hidden_states), self.target.hidden_size), dtype=self.target.dtype,
                                     device=self.target.device)
            self._has = [False] * len(hidden_states)
        for b, h in enumerate(hidden_states):
            if h.shape[0]:
                self._last[b] = h[-1]
                self._has[b] = True

    def _chain(self, ctx: DraftContext) -> DraftChain:
        return DraftChain(ctx.batch_size, self._last.device if self._last is not None else ctx.device,
                          self.options.min_confidence, ctx.sampling.greedy)

    def _draw(self, feature: torch.Tensor, ctx: DraftContext, chain: DraftChain):
        """One token per row from the head's guess on ``feature # [batch, H]`` after ``chain``'s
        tokens (through the copy gate, if any): ``(tokens # [batch], probs # [batch, vocab] | None,
        confidence # [batch] | None)``."""
        counts = ctx.counts_after(chain.tokens)
        if self.copier is None:
            return draw_scored(self.head(feature), ctx.sampling, ctx.generator, chain.scored, counts)
        return self.copier.draw(self.head.small(feature), feature, drafted_rows(ctx.token_ids, chain.tokens),
                                ctx.sampling, ctx.generator, counts)

    def _lengths(self, width: int) -> torch.Tensor:
        return torch.tensor([width if h else 0 for h in self._has], dtype=torch.long)


class MedusaDrafter(HeadDrafter):
    """Medusa-1 heads: all guesses from the newest state at once (one head per position)."""

    kind = "medusa"

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        m = min(k, self.module.num_heads)
        chain = self._chain(ctx)
        features = self.module(self._last, m)  # [batch, m, H]
        # all heads at once, unless a guess depends on the ones before it (the copy gate's
        # candidate, the penalties' context)
        if (self.copier is None or self.module.own_heads is not None) and not ctx.sampling.penalized:
            logits = self.module.logits(features, self.head)  # [batch, m, vocab]
            batch, _, vocab = logits.shape
            drawn = draw_scored(logits.reshape(batch * m, vocab), ctx.sampling, ctx.generator, chain.scored)
            tokens, probs, confidence = (None if x is None else x.view(batch, m, *x.shape[1:]) for x in drawn)
            for i in range(m):
                chain.add(*(None if x is None else x[:, i] for x in (tokens, probs, confidence)))
        else:
            for i in range(m):  # each candidate depends on the guesses before it
                if not chain.add(*self._draw(features[:, i], ctx, chain)):
                    break
        return chain.draft(self._lengths(m))


class MLPSpeculatorDrafter(HeadDrafter):
    """Multi-stage heads: stage i reads stage i-1's state and the token it chose."""

    kind = "mlp-speculator"

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        m = min(k, self.module.num_stages)
        token = torch.tensor([row[-1] for row in ctx.token_ids], device=self._last.device)  # x_{L-1}
        state, chain = self._last, self._chain(ctx)
        for i in range(m):
            state, feature = self.module.stage(i, state, self.target.embeddings(token))
            drawn = self._draw(feature, ctx, chain)  # [batch], [batch, vocab], [batch]
            token = drawn[0]
            if not chain.add(*drawn):
                break
        return chain.draft(self._lengths(m))


class EagleDrafter(HeadDrafter):
    """EAGLE-1: a one-layer decoder that runs ahead of the target at the feature level.

    The layer runs on specdraft's own block over a KV cache of its own (a layer runner from the
    drafter API, :func:`~specdraft.drafters.base.layer_runner`), fed ``fc([embed(x_{t+1}) ; f_t])``.
    The cache holds one entry per position ``j`` whose pair ``(f_j, x_{j+1})`` used the
    target's true state; the entries of guessed features are dropped at the next proposal
    (by writing the lengths back), and the pairs the target's latest states complete are fed
    in the same forward pass that gives the first guess (rows with fewer pairs are padded and
    advance by their own count).
    """

    kind = "eagle"

    def __init__(self, options: HeadOptions, target: TargetInfo) -> None:
        super().__init__(options, target)
        self.runner = layer_runner(self.module.layer, self.module.llama_config, attention_norm=False)

    def reset(self) -> None:
        super().reset()
        self._pairs: list[int] = []  # per row: cache entries made from true states
        self._pending: list[list[torch.Tensor]] = []  # per row: states not yet fed

    def on_hidden_states(self, ctx: DraftContext, hidden_states: list[torch.Tensor]) -> None:
        super().on_hidden_states(ctx, hidden_states)
        if len(self._pending) != len(hidden_states):
            self._pending = [[] for _ in hidden_states]
            self._pairs = [0] * len(hidden_states)
            self.runner.reset(len(hidden_states), max(len(t) for t in ctx.token_ids))
        for pending, h in zip(self._pending, hidden_states):
            if h.shape[0]:
                pending.append(h)

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, advance=None) -> torch.Tensor:
        """Feed pairs ``(features # [B, n, H], tokens # [B, n])``; returns guessed next features ``[B, n, H]``.
        Each row's cache grows by ``n``, or by ``advance[b]`` (rows padded past their pairs)."""
        return self.runner.forward(self.module.fc_in(features, self.target.embeddings(tokens)), advance=advance)

    def _catch_up(self, ctx: DraftContext, counts: list[int]) -> torch.Tensor:
        """Feed every row's pending true states; returns each row's newest guessed feature ``[batch, H]``."""
        batch, width, device = ctx.batch_size, max(counts), self._last.device
        starts = [p + 1 for p in self._pairs]  # pair j is (f_j, x_{j+1})
        even = all(n == width for n in counts)  # the common case (one row, or rows in step): no padding
        if even:
            features = torch.stack([torch.cat(p) for p in self._pending])
            tokens = torch.tensor([row[s : s + width] for row, s in zip(ctx.token_ids, starts)], device=device)
        else:
            features = torch.zeros((batch, width, self.target.hidden_size), dtype=self._last.dtype, device=device)
            tokens = torch.zeros((batch, width), dtype=torch.long)
            for b, (pending, n) in enumerate(zip(self._pending, counts)):
                if n:
                    features[b, :n] = torch.cat(pending)
                    tokens[b, :n] = torch.tensor(ctx.token_ids[b][starts[b] : starts[b] + n])
            tokens = tokens.to(device)
        for pending in self._pending:
            pending.clear()
        self._pairs = [p + n for p, n in zip(self._pairs, counts)]
        out = self._step(features, tokens, None if even else counts)  # [batch, width, H]
        if even:
            return out[:, -1]
        return out[torch.arange(batch, device=device), torch.tensor([max(n - 1, 0) for n in counts], device=device)]

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        self.runner.set_lengths(self._pairs)  # forget last round's guessed features
        self.runner.reserve(max(len(t) for t in ctx.token_ids) + k + 1)
        counts = [sum(h.shape[0] for h in p) for p in self._pending]
        if max(counts) == 0:
            return Draft.empty(ctx.batch_size, self._last.device)
        feature = self._catch_up(ctx, counts)
        chain = self._chain(ctx)
        for i in range(k):
            drawn = self._draw(feature, ctx, chain)  # [batch], [batch, vocab], [batch]
            if not chain.add(*drawn):
                break
            if i + 1 < k:  # the guessed pair: one position per row
                feature = self._step(feature[:, None], drawn[0][:, None])[:, 0]
        return chain.draft(self._lengths(k))
