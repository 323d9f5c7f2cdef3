"""``suffix``: SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975): trees of frequent continuations
from suffix tries over the request (prompt + output) and over earlier requests' outputs."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from .api import Draft, DraftContext, Drafter, TreeOptions, row_ids, tree_draft
from .common.suffix import SharedSuffix, SuffixStream


class SuffixDrafter(Drafter):
    """SuffixDecoding: a tree of the most frequent continuations of the context's longest matching suffix.

    It matches the longest suffix of the context (at most ``max_depth - 1`` tokens) in two tries of
    windows: the request's own (prompt + output so far, updated as tokens are accepted) and, with
    ``scope=shared``, one over the outputs of requests that have finished (the last
    ``shared_tokens`` tokens of them). Below each match it grows a tree of the most frequent
    continuations, best first by path probability, down to ``alpha`` times the match length;
    the tree with the higher expected acceptance (sum of path probabilities) is proposed.
    Deterministic (no ``probs``), so exact under sampling too.

    Sharing outputs across requests lets one request's speed reveal that a similar output was
    generated for another: ``scope=request`` turns sharing off.
    """

    api_version = 2

    class Options(TreeOptions):
        model_config = ConfigDict(extra="forbid")
        # 1 (chains), as the other lookup drafters: on the repeated-work workload on a 2-core EPYC,
        # chains ran 1.42x plain and a budget of 8 1.29x (docs/benchmarks.md); on a GPU try 8
        tree_budget: int = Field(1, ge=1, le=31, description=TreeOptions.model_fields["tree_budget"].description)
        max_depth: int = Field(24, ge=2, le=64, description="longest window the tries count, in tokens (match "
                                                           "length + draft depth)")
        alpha: float = Field(2.0, gt=0, description="draft at most alpha x the match length tokens deep")
        min_match: int = Field(1, ge=1, description="shortest suffix match that drafts")
        min_prob: float = Field(0.1, ge=0.0, le=1.0, description="leave out nodes whose path probability (product "
                                                                 "of continuation frequencies) is below this")
        scope: Literal["request", "shared"] = Field("shared", description="shared: also draft from earlier "
                                                                          "requests' outputs; request: from the "
                                                                          "request's own prompt and output only")
        shared_tokens: int = Field(20_000, ge=0, description="most tokens of earlier outputs kept (oldest "
                                                             "evicted first; memory about 5.5 KB per token of "
                                                             "varied text at max_depth 24)")

    def reset(self) -> None:
        o = self.options
        self._seqs: dict[int, tuple[SuffixStream, int]] = {}  # sequence id -> (stream, prompt length)
        self.shared = SharedSuffix(o.max_depth, o.shared_tokens) if o.scope == "shared" else None

    def on_join(self, seq_id: int, prompt: list[int]) -> None:
        self._seqs[seq_id] = (SuffixStream(self.options.max_depth, prompt), len(prompt))

    def on_leave(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None and self.shared is not None:
            stream, prompt_length = state
            self.shared.add(stream.tokens[prompt_length:])

    def _sync(self, seq_id: int, tokens: list[int], prompt_length: int) -> SuffixStream:
        """The sequence's stream, caught up with ``tokens`` (the tokens accepted since last seen)."""
        state = self._seqs.get(seq_id)
        if state is not None:
            stream = state[0]
            seen = len(stream.tokens)
            if seen <= len(tokens) and (seen == 0 or stream.tokens[-1] == tokens[seen - 1]):
                stream.extend(tokens[seen:])
                return stream
        # first sight (a context built by hand), or a sequence that is not the one seen: rebuild
        stream = SuffixStream(self.options.max_depth, tokens)
        self._seqs[seq_id] = (stream, prompt_length)
        return stream

    def _tree(self, stream: SuffixStream, tokens: list[int], k: int, budget: int, width: int):
        o = self.options
        best = stream.trie.draft(tokens, k, budget, width, o.alpha, o.min_match, o.min_prob)
        if self.shared is not None:
            other = self.shared.draft(tokens, k, budget, width, o.alpha, o.min_match, o.min_prob)
            if other[1] > best[1]:
                best = other
        return best[0]

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        tree = ctx.tree_budget > 1
        budget, width = (ctx.tree_budget, self.options.tree_width) if tree else (k, 1)
        rows = []
        for b, (seq_id, tokens) in enumerate(zip(row_ids(ctx), ctx.token_ids)):
            if not ctx.active[b]:
                rows.append([])
                continue
            stream = self._sync(seq_id, tokens, ctx.prompt_lengths[b])
            rows.append(self._tree(stream, tokens, k, budget, width))
        if tree:
            return tree_draft(rows, device=ctx.device)
        return Draft.from_lists([[token for _, token in row] for row in rows], device=ctx.device)

    def on_verified(self, ctx: DraftContext, num_accepted: list[int]) -> None:
        # catch up now, so that on_leave holds the whole output (its last round's tokens included)
        for b, (seq_id, tokens) in enumerate(zip(row_ids(ctx), ctx.token_ids)):
            if ctx.active[b] and seq_id in self._seqs:
                self._sync(seq_id, tokens, ctx.prompt_lengths[b])
