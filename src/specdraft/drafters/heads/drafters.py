"""``medusa``, ``eagle`` and ``mlp-speculator``: drafters that read the target's hidden states.

Each sets ``needs_hidden_states``, so the verifier hands it the target's last-layer states
of every committed position (see :meth:`Drafter.on_hidden_states`). With the tokens of
``ctx`` that is all a head needs: at ``propose`` time the newest state is ``f_{L-2}`` (``L``
tokens in the row), whose own next token ``x_{L-1}`` the target already chose, so the
heads guess ``x_L, x_{L+1}, ...``.

Draft distributions are each head's logits through ``logits_to_probs`` (the target's
processing), so sampling stays exact; greedy drafting takes the argmax. Heads with a copy
gate (:mod:`specdraft.drafters.common.copy_gate`) draw from, and report, the gated mixture instead.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..api import (ConfigError, Draft, DraftChain, DraftContext, Drafter, HeadOptions, SequenceSlots, TargetInfo,
                   TreeHeadOptions, chain_whole, drafts_whole, draw_scored, generators, row_ids)
from ..common.copy_gate import CopyDrafting, DraftedRows, drafted_rows


class HeadDrafter(Drafter):
    """Shared loading and hidden-state bookkeeping of the head drafters.

    The tree builders of :mod:`.tree` read ``module``, ``head``, ``copier``, ``options`` and
    ``has_state`` (and ``eagle``'s :meth:`EagleDrafter.step`), nothing private.
    """

    kind: ClassVar[str] = ""
    needs_hidden_states = True
    api_version = 2
    Options = HeadOptions

    def __init__(self, options: HeadOptions, target: TargetInfo) -> None:
        from ..common.shipped import find_shipped
        from .formats import FORMAT_FILE, load_heads

        path = options.heads or find_shipped(target, FORMAT_FILE, kind=self.kind)
        if path is None:
            raise ConfigError(
                f"{self.kind} has no shipped heads for target {target.name!r}: pass --drafter-option heads=DIR "
                f"(a folder from `specdraft train-heads --kind {self.kind}`, or a published checkpoint)"
            )
        self.module, self.head, self.meta = load_heads(path, target, self.kind)
        # drafting's own products on the fastest kernel here (the decoder layers run on a layer runner)
        services = getattr(target, "services", None)
        #: "q8_0" where the drafting products run on 8-bit blocks (``options.quantize``), else None
        self.quantize = None
        if hasattr(services, "fast_linears"):
            self.quantize = services.drafting_quantize(options.quantize, target.device, target.dtype)
            services.fast_linears(self.module, skip=("layer", "midlayer", "lm_head", "copy_gate"), quantize=self.quantize)
            self.head.product = services.fast_linear(self.head.weight, self.head.bias, quantize=self.quantize)
        gate = getattr(self.module, "copy_gate", None) if options.copy_gate else None
        self.copier = CopyDrafting(gate, self.head.head_ids, target.vocab_size, services) if gate is not None else None
        super().__init__(options, target)

    def reset(self) -> None:
        self._newest: dict[int, torch.Tensor] = {}  # sequence id -> its newest target state [H]
        self._last = torch.zeros((0, self.target.hidden_size), dtype=self.target.dtype, device=self.target.device)
        #: per row this round: whether it has any state yet (a 1-token prompt has none)
        self.has_state: list[bool] = []

    def on_leave(self, seq_id: int) -> None:
        self._newest.pop(seq_id, None)

    def on_hidden_states(self, ctx: DraftContext, hidden_states: list[torch.Tensor]) -> None:
        for seq_id, h in zip(row_ids(ctx), hidden_states):
            if h.shape[0]:
                self._newest[seq_id] = h[-1]

    def _rows(self, ctx: DraftContext) -> None:
        """This round's rows: ``_last # [batch, H]`` (zeros where a row has no state) and ``has_state``."""
        empty = torch.zeros(self.target.hidden_size, dtype=self.target.dtype, device=self.target.device)
        ids = row_ids(ctx)
        self.has_state = [i in self._newest for i in ids]
        self._last = torch.stack([self._newest.get(i, empty) for i in ids])

    def _chain(self, ctx: DraftContext) -> DraftChain:
        return DraftChain(ctx.batch_size, self._last.device, self.options.min_confidence, ctx.sampling.greedy)

    def _draw(self, feature: torch.Tensor, ctx: DraftContext, chain: DraftChain, k: int):
        """One token per row from the head's guess on ``feature # [batch, H]`` after ``chain``'s
        tokens (through the copy gate, if any; ``k`` the chain's length at most): ``(tokens #
        [batch], probs # [batch, vocab] | None, confidence # [batch] | None)``."""
        counts = ctx.counts_after(chain.tokens)
        if self.copier is None:
            return draw_scored(self.head(feature), ctx.sampling, generators(ctx), chain.scored, counts)
        return self.copier.draw(self.head.small(feature), feature, drafted_rows(ctx, chain.tokens, feature.device, k),
                                ctx.sampling, generators(ctx), counts)

    def _lengths(self, width: int) -> torch.Tensor:
        return torch.tensor([width if h else 0 for h in self.has_state], dtype=torch.long)


class MedusaDrafter(HeadDrafter):
    """Medusa-1 heads: all guesses from the newest state at once (one head per position).

    With ``ctx.tree_budget`` > 1: a tree of each head's ``tree_width`` best tokens (or draws), the
    product pruned to the budget by the heads' probabilities (:func:`.tree.medusa_tree`)."""

    kind = "medusa"
    Options = TreeHeadOptions

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        m = min(k, self.module.num_heads)
        self._rows(ctx)
        features = self.module(self._last, m)  # [batch, m, H]
        if ctx.tree_budget > 1:  # top-k per head, the product pruned to the budget
            from .tree import medusa_tree

            return medusa_tree(self, ctx, m, features)
        chain = self._chain(ctx)
        # all heads at once, unless a guess depends on the ones before it (the copy gate's
        # candidate, the penalties' context)
        if (self.copier is None or self.module.own_heads is not None) and not ctx.sampling.penalized:
            logits = self.module.logits(features, self.head)  # [batch, m, vocab]
            batch, _, vocab = logits.shape
            drawn = draw_scored(logits.reshape(batch * m, vocab), ctx.sampling, generators(ctx), chain.scored)
            tokens, probs, confidence = (None if x is None else x.view(batch, m, *x.shape[1:]) for x in drawn)
            for i in range(m):
                chain.add(*(None if x is None else x[:, i] for x in (tokens, probs, confidence)))
        else:
            for i in range(m):  # each candidate depends on the guesses before it
                if not chain.add(*self._draw(features[:, i], ctx, chain, m)):
                    break
        return chain.draft(self._lengths(m))


class MLPSpeculatorDrafter(HeadDrafter):
    """Multi-stage heads: stage i reads stage i-1's state and the token it chose."""

    kind = "mlp-speculator"

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        m = min(k, self.module.num_stages)
        self._rows(ctx)
        token = torch.tensor([row[-1] for row in ctx.token_ids], device=self._last.device)  # x_{L-1}
        state, chain = self._last, self._chain(ctx)
        for i in range(m):
            state, feature = self.module.stage(i, state, self.target.embeddings(token))
            drawn = self._draw(feature, ctx, chain, m)  # [batch], [batch, vocab], [batch]
            token = drawn[0]
            if not chain.add(*drawn):
                break
        return chain.draft(self._lengths(m))


class EagleDrafter(HeadDrafter):
    """EAGLE-1: a one-layer decoder that runs ahead of the target at the feature level.

    The layer runs on specdraft's own block over a KV cache of its own (a layer runner lent by
    ``target.services.layer_runner``), fed ``fc([embed(x_{t+1}) ; f_t])``.
    The cache holds one entry per position ``j`` whose pair ``(f_j, x_{j+1})`` used the
    target's true state; the entries of guessed features are dropped at the next proposal
    (by writing the lengths back), and the pairs the target's latest states complete are fed
    in the same forward pass that gives the first guess (rows with fewer pairs are padded and
    advance by their own count).

    With ``ctx.tree_budget`` > 1 it drafts EAGLE-2's dynamic tree from that first guess instead
    of a chain (:func:`.tree.eagle_tree`, copy gate included). The tree's nodes stay in the
    layer's cache past the true pairs and need no cleanup: the next proposal rolls back to
    ``_pairs`` and catches up on the target's states of the accepted path, which the engine hands
    over root first. ``Options`` is :class:`~specdraft.drafters.api.TreeHeadOptions` (the head
    options and ``tree_budget``, ``tree_width``), defined beside the others so the registry
    lists eagle without importing torch.
    """

    kind = "eagle"
    Options = TreeHeadOptions

    #: greedy chains drafted whole (:func:`~specdraft.drafters.common.base.chain_whole`: one CUDA
    #: graph per round, no host work between tokens): None, where the layer's runner has CUDA
    #: graphs; True or False to choose (tests run it on a CPU)
    whole_chain: bool | None = None

    def __init__(self, options: HeadOptions, target: TargetInfo) -> None:
        super().__init__(options, target)
        self.runner = self._layer_runner()
        self.runner.cache.reset(1, 256)

    def _layer_runner(self):
        """The draft layer on specdraft's own block, over a KV cache of its own."""
        return self.target.services.layer_runner(self.module.layer, self.module.llama_config, attention_norm=False,
                                                 **self._quantized())

    def _quantized(self) -> dict:
        """The layer runner's ``quantize`` argument, where the drafting products are quantized (a
        test's services may not take one otherwise)."""
        return {"quantize": self.quantize} if self.quantize else {}

    def reset(self) -> None:
        super().reset()
        self._pairs: dict[int, int] = {}  # sequence id -> cache entries made from true states
        self._pending: dict[int, list[torch.Tensor]] = {}  # sequence id -> states not yet fed
        self._slots = SequenceSlots()  # sequence id -> its row of the layer's cache
        if hasattr(self, "runner"):  # not yet while the base class's __init__ resets
            self.runner.cache.reset(1, 256)

    def on_join(self, seq_id: int, prompt: list[int]) -> None:
        self._pairs[seq_id], self._pending[seq_id] = 0, []
        slot = self._slots.join(seq_id)
        self.runner.cache.reserve(len(prompt) + 64, rows=self._slots.rows)
        self.runner.cache.set_lengths([0], slots=[slot])

    def on_leave(self, seq_id: int) -> None:
        super().on_leave(seq_id)
        self._pairs.pop(seq_id, None)
        self._pending.pop(seq_id, None)
        self._slots.leave(seq_id)

    def on_hidden_states(self, ctx: DraftContext, hidden_states: list[torch.Tensor]) -> None:
        super().on_hidden_states(ctx, hidden_states)
        for seq_id, tokens, h in zip(row_ids(ctx), ctx.token_ids, hidden_states):
            if seq_id not in self._pending:  # a context built without on_join (by hand)
                self.on_join(seq_id, tokens)
            if h.shape[0]:
                self._pending[seq_id].append(h)

    def _rows(self, ctx: DraftContext) -> None:
        """Which rows have a state (EAGLE drafts from its layer's features, not from the newest
        state, so none are stacked)."""
        self.has_state = [i in self._newest for i in row_ids(ctx)]

    def features(self, states: torch.Tensor) -> torch.Tensor:
        """The features ``[..., H]`` the layer reads, from the target's states as handed over
        (EAGLE: the final-norm states themselves)."""
        return states

    def step(self, features: torch.Tensor, tokens: torch.Tensor, slots: list[int], advance=None,
             tree_mask=None, depths=None) -> torch.Tensor:
        """Feed pairs ``(features # [B, n, H], tokens # [B, n])``; returns guessed next features ``[B, n, H]``.
        Each row's cache grows by ``n``, or by ``advance[b]`` (rows padded past their pairs).
        ``tree_mask``, ``depths``: the pairs are tree nodes (see :mod:`.tree`)."""
        return self.runner.forward(self.layer_input(features, tokens), advance=advance, slots=slots,
                                   tree_mask=tree_mask, depths=depths)

    def layer_input(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's input for pairs ``(features # [B, n, H], tokens # [B, n])``: ``fc([embed(x) ; f])``."""
        return self.module.fc_in(features, self.target.embeddings(tokens))

    def _catch_up(self, ctx: DraftContext, ids: list[int], counts: list[int]) -> torch.Tensor:
        """Feed every row's pending true states; returns each row's newest guessed feature ``[batch, H]``."""
        batch, width, device = ctx.batch_size, max(counts), self._last.device
        pendings = [self._pending[i] for i in ids]
        starts = [self._pairs[i] + 1 for i in ids]  # pair j is (f_j, x_{j+1})
        even = all(n == width for n in counts)  # the common case (one row, or rows in step): no padding
        if even:
            states = torch.stack([torch.cat(p) for p in pendings])
            tokens = torch.tensor([row[s : s + width] for row, s in zip(ctx.token_ids, starts)], device=device)
        else:
            size = next(p[0].shape[-1] for p in pendings if p)
            states = torch.zeros((batch, width, size), dtype=self._last.dtype, device=device)
            tokens = torch.zeros((batch, width), dtype=torch.long)
            for b, (pending, n) in enumerate(zip(pendings, counts)):
                if n:
                    states[b, :n] = torch.cat(pending)
                    tokens[b, :n] = torch.tensor(ctx.token_ids[b][starts[b] : starts[b] + n])
            tokens = tokens.to(device)
        features = self.features(states)  # [batch, width, H]
        for pending in pendings:
            pending.clear()
        for i, n in zip(ids, counts):
            self._pairs[i] += n
        out = self.step(features, tokens, self._slots.of(ids), None if even else counts)  # [batch, width, H]
        if even:
            return out[:, -1]
        return out[torch.arange(batch, device=device), torch.tensor([max(n - 1, 0) for n in counts], device=device)]

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        ids = row_ids(ctx)
        for seq_id, tokens in zip(ids, ctx.token_ids):
            if seq_id not in self._pending:
                self.on_join(seq_id, tokens)
        self._rows(ctx)
        slots = self._slots.of(ids)
        self.runner.cache.set_lengths([self._pairs[i] for i in ids], slots=slots)  # forget last round's guessed features
        tree = ctx.tree_budget > 1
        counts = [sum(h.shape[0] for h in self._pending[i]) for i in ids]
        if max(counts) == 0:
            return Draft.empty(ctx.batch_size, self._last.device)
        # every row of the catch-up writes max(counts) positions (padding past its own pairs), then the guesses
        self.runner.cache.reserve(max(self._pairs[i] for i in ids) + max(counts) + k * (self.options.tree_width if tree else 1)
                            + 1)
        feature = self._catch_up(ctx, ids, counts)
        if tree:  # EAGLE-2's dynamic tree
            from .tree import eagle_tree

            return eagle_tree(self, ctx, k, feature, slots)
        if drafts_whole(self.whole_chain, self.runner, ctx):  # the copy gate too
            return self._draft_whole(ctx, k, feature, slots)
        chain = self._chain(ctx)
        for i in range(k):
            drawn = self._draw(feature, ctx, chain, k)  # [batch], [batch, vocab], [batch]
            if not chain.add(*drawn):
                break
            if i + 1 < k:  # the guessed pair: one position per row
                feature = self.step(feature[:, None], drawn[0][:, None], slots)[:, 0]
        return chain.draft(self._lengths(k))

    def _draft_whole(self, ctx: DraftContext, k: int, feature: torch.Tensor, slots: list[int]) -> Draft:
        """The greedy chain of :meth:`propose` as one device function (:func:`chain_whole`); through
        the copy gate, if any, over the rows' tokens padded to a power of two (a graph per width)."""

        def next_feature(feature, tokens, step):
            return step(self.layer_input(feature[:, None], tokens[:, None]))[0][:, 0]

        draw, extras = None, ()
        if self.copier is not None:
            extras = drafted_rows(ctx, [], feature.device, k)  # the graph's inputs: the rows' tokens, padded

            def draw(feature, drafted, ids, lengths):
                rows = DraftedRows(ids, lengths).after(drafted)
                token, _, confidence = self.copier.draw(self.head.small(feature), feature, rows, ctx.sampling, None)
                return token, confidence

        tokens, lengths = chain_whole(self.runner, feature, k, self.options.min_confidence, self.head, next_feature,
                                      slots, key=(type(self).__name__, k, self.options.min_confidence), draw=draw,
                                      extras=extras)
        return Draft(token_ids=tokens, probs=None, lengths=torch.minimum(lengths, self._lengths(k).to(lengths.device)))


class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 (:class:`~.modules.Eagle3Draft`): EAGLE's drafting loop, chains and dynamic trees,
    on the target's states at three layers (:attr:`hidden_layers`, from the heads' config).

    The verifier hands over the chosen layers' states side by side (``3 * H`` wide); they wait
    until the layer next catches up, where ``fc`` fuses them into features in one product (a
    round that does not draft costs nothing more), and from then on the pairs are EAGLE's: the
    layer's input is ``[embed(x_{t+1}) ; g_t]`` and its output, the next feature, is both fed
    back and turned into draft-vocabulary logits by the heads' own norm and LM head
    (``self.head``, entry ``i`` being target token ``i + d2t[i]``; tokens outside the draft
    vocabulary get probability 0 and are never drafted). Draft distributions are scattered to
    the target's vocabulary before acceptance, so verification is unchanged and exact.
    """

    kind = "eagle3"

    def __init__(self, options: HeadOptions, target: TargetInfo) -> None:
        super().__init__(options, target)
        self.hidden_layers = self.module.aux_layers

    def _layer_runner(self):
        return self.target.services.layer_runner(self.module.midlayer, self.module.llama_config, **self._quantized())

    def features(self, states: torch.Tensor) -> torch.Tensor:
        """``fc`` over the chosen layers' states side by side, once per catch-up rather than per
        round (on specdraft's CPU panels a row's result is the same either way; elsewhere its last
        bits may differ, which can change a draft, never the output).  # [..., 3H] -> [..., H]"""
        return self.module.fc(states)

    def layer_input(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.target.embeddings(tokens), features], dim=-1)  # [B, n, 2H]
