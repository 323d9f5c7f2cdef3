"""``draft-model``: a small causal LM drafts K tokens autoregressively (``llama-1b`` is one).

The draft runs on a model runner of its own (``target.services.model_runner``: specdraft's model
code over a static KV cache). Before each proposal it brings that cache up to
date with the tokens accepted since its last call: it rolls back to the longest prefix it
computed that is still valid, then feeds everything after it, the prompt on the first round
(lazy prefill), or, after a fully accepted round, its own last drafted token plus the target's
bonus token (catch-up), in the same forward pass that yields the first new draft. Then K-1
single-token steps follow.

With ``ctx.tree_budget`` > 1 it drafts EAGLE-2's dynamic tree instead
(:func:`~specdraft.drafters.api.grow_tree`): the top ``tree_width`` tokens (or draws)
at each level, the most probable nodes fed in one pass per level with a tree mask. The tree's
entries are left past the fed tokens and rolled back at the next proposal like a rejected chain.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from pydantic import Field

from .api import (ConfigError, Draft, DraftChain, DraftContext, Drafter, DrafterError, LearntDrafterOptions,
                  ModelLoadError, SequenceSlots, TargetInfo, TreeOptions, chain_whole, drafts_whole, draw_scored,
                  generators, grow_tree, node_contexts, processed_probs, row_ids)

LLAMA_1B = "meta-llama/Llama-3.2-1B-Instruct"


def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str, sample_every: int = 97) -> None:
    """Raise ConfigError unless the two tokenizers map tokens to the same ids."""

    def fail(what: str) -> None:
        raise ConfigError(
            f"draft model {draft_name!r} cannot draft for target {target_name!r}: their tokenizers differ ({what}). "
            "Speculative decoding needs a draft with the target's vocabulary; pick a model of the same family"
        )

    if len(target_tok) != len(draft_tok):
        fail(f"vocabulary of {len(target_tok)} vs {len(draft_tok)} tokens")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            fail(f"{attr} is {a} vs {b}")
    ids = list(range(0, len(target_tok), sample_every)) + [len(target_tok) - 1]
    ta, da = target_tok.convert_ids_to_tokens(ids), draft_tok.convert_ids_to_tokens(ids)
    for i, a, b in zip(ids, ta, da):
        if a != b:
            fail(f"id {i} is {a!r} vs {b!r}")


def check_vocabulary(model, target: TargetInfo, draft_name: str) -> int:
    """Refuse a draft whose embedding or output head cannot cover every token id the target's
    tokenizer has (its rows past the tokenizer, padding, are allowed); returns the embedding's rows."""
    needed = len(target.tokenizer) if target.tokenizer is not None else target.vocab_size
    rows = model.get_input_embeddings().weight.shape[0]
    head = model.get_output_embeddings()
    width = getattr(head, "vocab_size", None) or head.weight.shape[0]  # a compact draft's head scatters
    for what, size in (("input embedding", rows), ("output head", width)):
        if size < needed:
            raise ConfigError(
                f"draft model {draft_name!r} cannot draft for target {target.name or 'target'!r}: its {what} has "
                f"{size} rows but the target uses token ids 0..{needed - 1} ({needed} tokens). Use a draft with "
                "the target's vocabulary (a model of the same family)"
            )
    return rows


class DraftModelDrafter(Drafter):
    """Autoregressive drafting with a smaller model that shares the target's tokenizer.

    Each running sequence holds a row of the draft's own cache (:class:`SequenceSlots`).
    """

    api_version = 2

    #: greedy chains drafted whole (:func:`~specdraft.drafters.common.base.chain_whole`: one CUDA
    #: graph per round): None, where the draft's runner has CUDA graphs; True or False to choose
    whole_chain: bool | None = None

    class Options(LearntDrafterOptions, TreeOptions):
        model: str | None = Field(None, description="hub id, local folder or .gguf file of the draft model "
                                                    "(default: the draft shipped for the target, if any)")
        dtype: str | None = Field(None, description="default: the target's dtype")
        device: str | None = Field(None, description="default: the target's device")
        compile: bool | None = Field(None, description="torch.compile the draft (CUDA graphs on a GPU); "
                                                       "default: the device's default")

    def __init__(self, options: Options, target: TargetInfo) -> None:
        from .common.compact_draft import FORMAT_FILE, is_compact_draft, load_compact_draft
        from .common.shipped import find_shipped

        services = target.services  # a runner and model loading, lent by specdraft
        source = options.model
        if source is None:
            shipped = find_shipped(target, FORMAT_FILE)
            if shipped is None:
                raise ConfigError(
                    f"draft-model has no shipped draft for target {target.name!r}: pass one with "
                    "--drafter-option model=HUB_ID_OR_PATH (same tokenizer as the target), or build one "
                    "with `specdraft distill`"
                )
            source = str(shipped)
        device = services.resolve_device(options.device or target.device)
        dtype = services.resolve_dtype(options.dtype, device) if options.dtype else target.dtype
        if is_compact_draft(source):
            model, meta = load_compact_draft(source, target.embeddings, target.name, dtype, device)
            tokenizer, name = None, meta.get("name", source)
        else:
            try:
                model, tokenizer, name = services.load_model(source, dtype=dtype, device=device,
                                                             option="--drafter-option model")
            except ModelLoadError as exc:  # it says what is wrong with the path or id; say which model it is
                raise ModelLoadError(f"draft model: {exc}") from None
        self.model, self.draft_name = model, name
        if tokenizer is not None and target.tokenizer is not None:
            check_tokenizers(target.tokenizer, tokenizer, target.name or "target", name)
        self.embedding_rows = check_vocabulary(model, target, name)
        self.runner = services.model_runner(model, compile=options.compile)
        gate = getattr(model, "copy_gate", None) if options.copy_gate else None
        self.copier = None
        if gate is not None:
            from .common.copy_gate import CopyDrafting

            self.copier = CopyDrafting(gate, model.lm_head.head_ids, target.vocab_size, getattr(target, "services", None))
        super().__init__(options, target)

    def reset(self) -> None:
        self._fed: dict[int, list[int]] = {}  # sequence id -> the tokens whose keys/values its cache row holds
        # sequence id -> drafted tokens fed after ``_fed`` last round (on the device: never copied), then
        # how many of them the verifier accepted (those are the next context's tokens there)
        self._drafts_fed: dict[int, int] = {}
        self._drafts_kept: dict[int, int] = {}
        self._slots = SequenceSlots()
        self.runner.cache.reset(1, 256)

    def on_join(self, seq_id: int, prompt: list[int]) -> None:
        self._fed[seq_id] = []
        slot = self._slots.join(seq_id)
        self.runner.cache.reserve(len(prompt) + 64, rows=self._slots.rows)
        self.runner.cache.set_lengths([0], slots=[slot])

    def on_leave(self, seq_id: int) -> None:
        self._fed.pop(seq_id, None)
        self._drafts_fed.pop(seq_id, None)
        self._drafts_kept.pop(seq_id, None)
        self._slots.leave(seq_id)

    def _sync(self, ctx: DraftContext, seq_ids: list[int]) -> list[list[int]]:
        """Roll the cache back to the still-valid prefix of each row; return what is still to feed."""
        for seq_id, tokens in zip(seq_ids, ctx.token_ids):
            if seq_id not in self._fed:  # a context built without on_join (by hand)
                self.on_join(seq_id, tokens)
        for seq_id, tokens in zip(seq_ids, ctx.token_ids):  # the accepted drafts fed: the context's tokens there
            kept, fed = self._drafts_kept.pop(seq_id, 0), self._fed[seq_id]
            self._drafts_fed.pop(seq_id, None)
            fed.extend(tokens[len(fed):len(fed) + kept])
        pending, keep = [], []
        for fed, tokens in zip((self._fed[i] for i in seq_ids), ctx.token_ids):
            limit = min(len(fed), len(tokens) - 1)
            n = limit if fed[:limit] == tokens[:limit] else 0  # the common case, compared in C
            while n < limit and fed[n] == tokens[n]:
                n += 1
            del fed[n:]
            keep.append(n)
            pending.append(tokens[n:])
        self.runner.cache.set_lengths(keep, slots=self._slots.of(seq_ids))
        return pending

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        import torch

        device = self.model.device
        seq_ids = row_ids(ctx)
        pending = self._sync(ctx, seq_ids)
        highest = max((max(p) for p in pending if p), default=0)
        if highest >= self.embedding_rows:
            raise DrafterError(
                f"drafter {self.name or 'draft-model'!r} (draft model {self.draft_name!r}) was handed token id "
                f"{highest}, which its embedding of {self.embedding_rows} rows cannot embed; the target produced "
                "a token outside the draft's vocabulary: use a draft with the target's full vocabulary"
            )
        tree = ctx.tree_budget > 1 and getattr(self.runner, "supports_tree", False)
        width = max(len(p) for p in pending)
        # every row of the first pass writes ``width`` positions (padding past its own tokens), then the drafts
        stored = max(len(self._fed[i]) for i in seq_ids)
        self.runner.cache.reserve(stored + width + k * (self.options.tree_width if tree else 1) + 1)
        feed = torch.zeros((ctx.batch_size, width), dtype=torch.long)
        for b, p in enumerate(pending):  # right-padded; each row advances by its own count
            feed[b, : len(p)] = torch.tensor(p)
        # with a copy gate the head returns its own logits [..., N]: the mixture works in that space
        with self.model.lm_head.unscattered() if self.copier is not None else nullcontext():
            return self._draft(ctx, k, pending, feed.to(device), seq_ids, tree)

    def _draft(self, ctx: DraftContext, k: int, pending: list[list[int]], feed, seq_ids: list[int],
               tree: bool = False) -> Draft:
        import torch

        from .common.copy_gate import drafted_rows

        device, gated = feed.device, self.copier is not None
        # only each row's last fed position needs logits: on a lazy prefill of a long prompt, logits
        # (and the head's scatter into the full vocabulary) at every position cost a third of the pass
        last = torch.tensor([[len(p) - 1] for p in pending], device=device)  # [batch, 1]
        slots = self._slots.of(seq_ids)
        fed_rows = [self._fed[i] for i in seq_ids]
        logits, hidden = self.runner.forward(feed, logits_at=last, hidden=gated, advance=[len(p) for p in pending],
                                             slots=slots)
        step_logits = logits[:, 0]  # [batch, vocab_d]
        step_hidden = hidden.gather(1, last[..., None].expand(-1, -1, hidden.shape[-1]))[:, 0] if gated else None
        for fed, p in zip(fed_rows, pending):
            fed.extend(p)
        if tree:
            return self._tree(ctx, k, step_logits, step_hidden, slots)

        if drafts_whole(self.whole_chain, self.runner, ctx):
            tokens, lengths = self._draft_whole(ctx, k, step_logits, step_hidden, slots)
            if k > 1:  # every row fed k - 1 drafted tokens
                self._drafts_fed.update((i, k - 1) for i in seq_ids)
            return Draft(token_ids=tokens, lengths=lengths)
        chain = DraftChain(ctx.batch_size, device, self.options.min_confidence, ctx.sampling.greedy)
        fed_now = 0  # drafted tokens fed below (never copied to the host: the accepted ones come back in the context)
        for i in range(k):
            if self.copier is None:  # [batch], [batch, vocab] | None, [batch] | None
                drawn = draw_scored(self._to_target_vocab(step_logits), ctx.sampling, generators(ctx), chain.scored,
                                    ctx.counts_after(chain.tokens))
            else:
                drawn = self.copier.draw(step_logits, step_hidden, drafted_rows(ctx, chain.tokens, device, k),
                                         ctx.sampling, generators(ctx), ctx.counts_after(chain.tokens))
            token = drawn[0]
            if not chain.add(*drawn):
                break
            if i + 1 < k:
                logits, hidden = self.runner.forward(token[:, None], hidden=gated, slots=slots)
                step_logits, step_hidden = logits[:, -1], (hidden[:, -1] if gated else None)
                fed_now += 1
        if fed_now:
            self._drafts_fed.update((i, fed_now) for i in seq_ids)
        return chain.draft()

    def _draft_whole(self, ctx: DraftContext, k: int, logits, hidden, slots: list[int]):
        """The greedy chain of :meth:`_draft` as one device function (:func:`chain_whole`): ``(tokens
        # [batch, k], lengths # [batch])`` from the first pass's ``logits # [batch, vocab_d]`` (and
        ``hidden # [batch, H]`` with a copy gate, whose choice reads the rows' tokens padded to a
        power of two: a graph per width)."""
        from .common.copy_gate import DraftedRows, drafted_rows

        key = ("draft-model", k, self.options.min_confidence, self.copier is not None)
        if self.copier is None:
            return chain_whole(self.runner, logits, k, self.options.min_confidence, self._to_target_vocab,
                               lambda _, token, step: step(token[:, None])[0][:, -1], slots, key=key)

        def next_state(_, token, step):
            logits, hidden = step(token[:, None], hidden=True)
            return logits[:, -1], hidden[:, -1]

        def draw(state, drafted, ids, lengths):
            token, _, confidence = self.copier.draw(*state, DraftedRows(ids, lengths).after(drafted), ctx.sampling, None)
            return token, confidence

        return chain_whole(self.runner, (logits, hidden), k, self.options.min_confidence, None, next_state, slots,
                           key=key, draw=draw, extras=drafted_rows(ctx, [], logits.device, k))

    def on_verified(self, ctx: DraftContext, num_accepted: list[int]) -> None:
        """The drafted tokens fed last round that were accepted hold valid keys and values: the next
        :meth:`_sync` keeps them (the context has them); the rest is rolled back."""
        for seq_id, accepted in zip(row_ids(ctx), num_accepted):
            fed = self._drafts_fed.get(seq_id, 0)
            if fed:
                self._drafts_kept[seq_id] = min(accepted, fed)

    def _tree(self, ctx: DraftContext, k: int, logits, hidden, slots: list[int]) -> Draft:
        """A dynamic tree from the first step's ``logits # [batch, vocab_d]`` (``hidden # [batch, H]``
        with a copy gate); its nodes are not recorded in ``_fed``, so the next sync drops them."""
        copier = self.copier
        state = {"logits": logits, "hidden": hidden}  # the expanded nodes': [rows, vocab_d], [rows, H] | None
        device = self.model.device  # the draft's own; the tree is grown on the target's (ctx.device)

        def counts_here(counts):  # the penalties' context, where the draft's logits are
            if counts is None or counts.in_context.device == device:
                return counts
            return type(counts)(counts.in_context.to(device), counts.in_output.to(device))

        def next_probs(level, paths, sampling, counts):
            if copier is None:
                q = processed_probs(self._to_target_vocab(state["logits"]), sampling, counts_here(counts))
            else:
                q = processed_probs(state["logits"], sampling, counts_here(counts), copier, state["hidden"],
                                    node_contexts(ctx, paths))
            return q.to(ctx.device)

        def feed(up, tokens, tree_mask, depths):  # the nodes' own tokens; the mask says whose children they are
            out, hid = self.runner.forward(tokens.to(device), hidden=copier is not None, slots=slots,
                                           tree_mask=tree_mask.to(device), depths=depths.to(device))
            state["logits"] = out.reshape(-1, out.shape[-1])
            state["hidden"] = None if hid is None else hid.reshape(-1, hid.shape[-1])

        return grow_tree(ctx, k, self.options.tree_width, ctx.tree_budget, [True] * ctx.batch_size, next_probs, feed,
                         self.options.min_confidence)

    def _to_target_vocab(self, logits: Any):
        """Draft logits ``[batch, vocab_d]`` -> ``[batch, vocab_t]``: rows past the target's are padding."""
        import torch

        vt = self.target.vocab_size
        if logits.shape[-1] > vt:
            return logits[:, :vt]
        if logits.shape[-1] < vt:
            pad = torch.full((logits.shape[0], vt - logits.shape[-1]), float("-inf"), dtype=logits.dtype,
                             device=logits.device)
            return torch.cat([logits, pad], dim=-1)
        return logits
