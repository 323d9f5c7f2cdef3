"""API-version-1 drafters behind the API-2 interface the engine speaks: their waves, in one adapter."""

from __future__ import annotations

import torch

from ..sampling import RowSampling, TokenCounts
from ..types import Draft, DraftContext
from ..verifier import check_draft


class WaveDrafter:
    """Runs an API-version-1 drafter (state by row index, forgotten at ``reset()``) as an API-2 one.

    Sequences that join an empty batch form a wave: the drafter is ``reset()`` and sees the wave's
    rows in a fixed order until all of them have left; a row that has left stays, with ``active``
    False and its last tokens, and proposes nothing that is verified. The engine's scheduler admits
    no one while a wave runs (:class:`~specdraft.engine.scheduler.Scheduler` ``waves=True``), so
    the engine's rounds never remap rows: this adapter does, between the engine's rows (the
    running sequences) and the wave's.
    """

    api_version = 2

    def __init__(self, drafter, verifier) -> None:
        self.inner = drafter
        self.verifier = verifier  # checks the wave's drafts before rows are picked from them
        self.wave: list[int] = []  # sequence ids, in the drafter's row order
        self.live: set[int] = set()
        self.last: dict[int, tuple] = {}  # sequence id -> (tokens, prompt length, sampling, generator) last seen
        self._round: tuple | None = None  # (engine context, wave context, engine row of each wave row or None)

    def __getattr__(self, name: str):  # name, plugin, tree_budget, needs_hidden_states, ...
        return getattr(self.inner, name)

    def on_join(self, seq_id: int, prompt: list[int]) -> None:
        if not self.live:  # a new wave
            self.wave, self.last = [], {}
            self.inner.reset()
        self.wave.append(seq_id)
        self.live.add(seq_id)

    def on_leave(self, seq_id: int) -> None:
        self.live.discard(seq_id)

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        wave, rows = self._wave(ctx)
        draft = self.inner.propose(wave, k)
        ids, lengths, probs, parents = check_draft(draft, wave.batch_size, k, self.verifier.vocab_size,
                                                   self.verifier.who, self.verifier.device,
                                                   full=self.verifier.full_checks)
        pick = torch.tensor([self.wave.index(i) for i in ctx.seq_ids], device=ids.device)
        return Draft(token_ids=ids[pick], probs=None if probs is None else probs[pick], lengths=lengths[pick],
                     parents=None if parents is None else parents[pick])

    def on_hidden_states(self, ctx: DraftContext, hidden_states: list) -> None:
        wave, rows = self._wave(ctx)
        empty = hidden_states[0][:0]  # [0, dim]
        self.inner.on_hidden_states(wave, [empty if b is None else hidden_states[b] for b in rows])

    def on_verified(self, ctx: DraftContext, num_accepted: list[int]) -> None:
        wave, rows = self._wave(ctx)
        wave.num_verified = [0 if b is None else ctx.num_verified[b] for b in rows]
        wave.accepted_nodes = [[] if b is None else ctx.accepted_nodes[b] for b in rows]
        self.inner.on_verified(wave, [0 if b is None else num_accepted[b] for b in rows])

    def _wave(self, ctx: DraftContext) -> tuple[DraftContext, list[int | None]]:
        """The wave's context for the engine's ``ctx`` (one per round: ``propose`` and
        ``on_verified`` see the same), and the engine's row of each wave row (None: it has left)."""
        if self._round is not None and self._round[0] is ctx:
            return self._round[1:]
        here = {seq_id: b for b, seq_id in enumerate(ctx.seq_ids)}
        for seq_id, b in here.items():
            self.last[seq_id] = (ctx.token_ids[b], ctx.prompt_lengths[b], ctx.sampling[b], ctx.generators[b])
        known = [self.last[i] for i in self.wave]
        token_ids, prompt_lengths, sampling = [r[0] for r in known], [r[1] for r in known], RowSampling(r[2] for r in known)
        wave = DraftContext(
            token_ids=token_ids, prompt_lengths=prompt_lengths, active=[i in here for i in self.wave],
            vocab_size=ctx.vocab_size, device=ctx.device, sampling=sampling, generator=ctx.generator,
            generators=[r[3] for r in known], seq_ids=list(self.wave), tree_budget=ctx.tree_budget,
            counts=TokenCounts.of(token_ids, prompt_lengths, ctx.vocab_size, ctx.device) if sampling.penalized else None,
        )
        self._round = (ctx, wave, [here.get(i) for i in self.wave])
        return self._round[1:]
