"""The engine: continuous batching of speculative decoding.

One step, for the sequences running in it (each holds a row of the target's cache, its slot)::

    schedule  retire aborted sequences; admit waiting ones into free slots and prefill them
    propose   d_1..d_k'          <- drafter.propose(ctx, k)          (k' <= k, per sequence)
    verify    logits             <- target([last, d_1..d_k'])        one pass over the running slots
    accept    n, next            <- greedy or rejection sampling      (per sequence: its settings,
                                                                      its own generator; EOS and stop
                                                                      tokens masked before min_tokens)
    commit    emit d_1..d_n, next (stop conditions token by token); cache length += n + 1;
              finished sequences leave at once and free their slot; requests that ask get the
              tokens' log-probabilities from the same logits (:mod:`.logprobs`)

The :class:`~specdraft.engine.scheduler.Scheduler` decides who runs; the
:class:`~specdraft.verifier.Verifier` turns the draft into a proposal, runs the pass and accepts.
The cache holds every token of a sequence but its last one, which is fed first in the next
round. A round where nobody drafted anything is a plain one-token decoding step.
"""

from __future__ import annotations

import atexit
import heapq
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from ..errors import DrafterError, SpecdraftError
from ..sampling import RowSampling, TokenCounts
from ..types import DraftContext, TargetInfo, TargetRunner
from ..verifier import Outcome, Proposal, Verifier
from ..verifier.prediction import MAX_PREDICTED
from .processors import GrammarMasks, HoldStops, LogitBias, RowState, process
from .logprobs import round_logprobs
from .memory import DEFAULT_KV_MEMORY, KVMemory
from .output import first_stop, stop_floor
from .policy import AdaptiveDraftLength
from .prefix import DEFAULT_MEMORY, PrefixCache, turn_ends
from .report import Observer, StepReport, finish_report, notify, prefill_report, round_report
from .scheduler import Scheduler
from .sequence import Sequence, Status, mix_seed
from .waves import WaveDrafter

#: Prompt tokens per prefill pass by default: a newcomer then delays the running requests' next
#: round by one such pass at most (see :meth:`Engine._prefill`).
DEFAULT_PREFILL_CHUNK = 256
#: Prompt tokens one step prefills at most when chunking is off (``prefill_chunk=0``; a prompt
#: longer than this still goes in one pass, in a step of its own).
PREFILL_BUDGET = 4096


def _rows_bucket(rows: int) -> int:
    """Batch sizes that share a draft-length policy (verify costs depend on the batch)."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return bucket


def drafter_label(drafter) -> str:
    """How errors name a drafter: its registered name (or class) and its plugin."""
    name = getattr(drafter, "name", "") or type(drafter).__name__
    plugin = getattr(drafter, "plugin", "")
    return f"{name!r}" + (f" (plugin {plugin!r})" if plugin else "")


@dataclass
class _Plan:
    """A round before it runs: the drafter's context, each row's cap, the rows that draft from
    their request's prediction, and the draft length the drafter is asked for."""

    ctx: DraftContext
    caps: list[int]  # [batch] tokens (a tree's levels) each row may have verified
    policy: AdaptiveDraftLength | None
    predicted: dict[int, list[int]] = field(default_factory=dict)  # row -> its predicted draft

    @property
    def k(self) -> int:
        """What the drafter is asked for (0: it is not called): its rows' largest cap."""
        return max((c for b, c in enumerate(self.caps) if b not in self.predicted), default=0)


class Engine:
    """Runs speculative decoding of the target's ``runner`` with ``drafter`` for sequences that
    join and leave between steps. ``add`` and ``abort`` may be called from any thread; ``step``
    from one thread at a time (:class:`EngineLoop` does). A drafter of API version 1 runs through
    :class:`~specdraft.engine.waves.WaveDrafter`, in waves."""

    def __init__(self, runner: TargetRunner, drafter, target: TargetInfo, spec_length: int, adaptive: bool = True,
                 max_batch: int = 8, max_waiting: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prefix_cache_memory: int = DEFAULT_MEMORY,
                 kv_cache_memory: int = DEFAULT_KV_MEMORY) -> None:
        self.runner = runner  # specdraft.runner: ModelRunner or TransformersRunner
        self.drafter = drafter
        self.target = target
        self.spec_length = spec_length
        self.adaptive = adaptive
        #: prompt tokens per prefill pass, and at most per step while others decode (0: whole prompts)
        self.prefill_chunk = prefill_chunk
        #: a conversation's turn mark (the chat template's generation prompt but its last token;
        #: empty: none): a prefill pass also ends after each one, where an earlier turn's prompt
        #: ended, so the prefix cache holds all of that prompt for the next turn (see :meth:`_pass_end`)
        self.turn_mark: tuple[int, ...] = ()
        self._filling: list[Sequence] = []  # admitted sequences still prefilling, first come first
        self._prefill_steps = 0  # steps that prefilled: how long a prompt has waited (see _prefill_order)
        waves = getattr(drafter, "api_version", 1) < 2
        self.scheduler = Scheduler(max_batch, max_waiting, waves=waves)
        self.verifier = Verifier(runner, target.vocab_size, target.device, who=drafter_label(drafter))
        #: what requests do to the target's distribution, in order (see :mod:`.processors`)
        self.processors = (LogitBias(), GrammarMasks(), HoldStops())
        self._drafting = WaveDrafter(drafter, self.verifier) if waves else drafter  # what the rounds call
        #: the drafter never proposes (``none``): rounds are plain steps, and it is not asked
        self.never_drafts = bool(getattr(drafter, "never_drafts", False))
        #: draft-length policies per batch-size bucket: verify costs differ with the batch
        self.policies: dict[int, AdaptiveDraftLength] = {}
        #: what makes them, called with the most tokens a round drafts (benchmarks/policy_ab.py
        #: gives one decoder another policy, to run two side by side)
        self.policy_class = AdaptiveDraftLength
        self._drafted_last = False
        self._drafter_s = 0.0  # seconds spent in the drafter's calls (a clock the rounds read)
        self._shared: torch.Generator | None = None  # the round's one generator (``ctx.generator``)
        #: called on the engine's thread with a StepReport per round, prefill pass and leaving
        #: sequence (see :mod:`specdraft.engine.report`); a failing one is logged once, never raised
        self.observers: list[Observer] = []
        self._failed_observers: set[int] = set()
        cache = self.runner.cache
        #: the target cache's memory bound (:mod:`.memory`); None: a cache that cannot be sized by
        #: use (transformers' fallback: a row per ``max_batch`` slot)
        self.memory: KVMemory | None = None
        if getattr(cache, "fit", None) is not None:
            widest = max(spec_length, int(getattr(drafter, "tree_budget", 1) or 1), MAX_PREDICTED)
            self.memory = KVMemory(cache, kv_cache_memory, widest)
        self.reset_cache()
        #: prompt passes kept across requests (:mod:`.prefix`); None: off (asked, or
        #: a cache that cannot keep them: transformers' fallback)
        self.prefix: PrefixCache | None = None
        if prefix_cache_memory > 0 and getattr(cache, "save_block", None) is not None:
            self.prefix = PrefixCache(cache, prefix_cache_memory, cache.token_bytes)

    def reset_cache(self) -> None:
        """An empty target cache (nothing may be running): one short row, grown as sequences join
        (:mod:`.memory`; a row per slot when it cannot be); the prefix cache keeps its blocks."""
        if self.memory is not None:
            self.runner.cache.reset(1, 0)
        else:
            self.runner.cache.reset(self.scheduler.max_batch, 256)

    # -- requests (any thread) ------------------------------------------------------------

    def add(self, sequences: list[Sequence], limit: bool = True) -> None:
        """Queue ``sequences``; QueueFull (none queued) when ``limit`` and the waiting queue is full,
        ConfigError when one could never fit the KV cache's memory."""
        if self.memory is not None:
            self.memory.check(sequences)
        self.scheduler.add(sequences, limit)

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq``: a waiting one at once, a running one at the start of the next step."""
        self.scheduler.abort(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- one step -------------------------------------------------------------------------

    def step(self) -> None:
        """schedule -> propose -> verify -> accept -> commit; a failure fails only the requests it touched."""
        with torch.inference_mode():
            for s in self.scheduler.aborted():
                self._leave(s, "aborted")
            joined = self.scheduler.admit(None if self.memory is None else self.memory.admission)
            if joined:
                self._guarded(joined, self._join)
            if self._filling:
                self._prefill()
            ready = [s for s in self.scheduler.running if not s.prefilling]
            if ready:
                self._guarded(ready, self._round)
            if self.memory is not None and not self.scheduler.running:
                self.memory.fit([])  # idle: memory back

    def _round(self, batch: list[Sequence]) -> None:
        if self.memory is not None:  # room for the widest pass after the longest row
            self.memory.fit(self.scheduler.running)
        plan = self._plan(batch)  # the engine's, paid by plain decoding too: "other", not drafting
        t0 = time.perf_counter()
        draft = self._call("propose", plan.ctx, plan.k) if plan.k > 0 else None
        proposal = self.verifier.proposal(draft, plan.caps, plan.predicted)  # validated once; a chain or a tree
        t1 = time.perf_counter()
        last, slots, longest = [s.tokens[-1] for s in batch], [s.slot for s in batch], max(s.cached for s in batch)
        if self._greedy_alone(batch, plan) and self.verifier.greedy_in_pass(proposal):  # acceptance in the pass
            outcome = self.verifier.verify_greedy(proposal, last, slots, longest, hidden=self.wants_hidden)
            logprobs = {}
        else:
            logits, hidden = self.verifier.verify(proposal, last, slots, longest, hidden=self.wants_hidden)
            raw_logits = logits  # the model's own (logprobs_mode "raw"); the processors make copies
            logits = process(self.processors, self._rows(batch), proposal, logits)
            self._grammar_failures(batch)
            outcome = self.verifier.accept(proposal, logits, plan.ctx.sampling, self._generators(batch),
                                           plan.ctx.counts, hidden)
            logprobs = round_logprobs(batch, outcome, raw_logits, logits, plan.ctx.counts)  # rows that asked
        t2, called = time.perf_counter(), self._drafter_s
        committed = self._commit(batch, outcome, logprobs)
        for s, n in zip(batch, committed):  # each grammar's matcher over its row's new tokens
            if s.grammar is not None and s.finish_reason is None and n > 0:
                s.grammar.advance(s.tokens[len(s.tokens) - n :])
        self._observe(round_report(batch, outcome, committed, plan.predicted, draft_s=t1 - t0, verify_s=t2 - t1))
        for s, n in zip(batch, committed):  # after the observers: what a reader has got is counted already
            s.events.put(("tokens", s.tokens[len(s.tokens) - n:]))
        self._learn(batch, plan, proposal, outcome, draft_s=t1 - t0, verify_s=t2 - t1)
        self._report(plan, outcome, committed)
        heard = self._drafter_s - called  # the drafter's calls after the verify pass (its states, what was kept)
        for s in batch:  # the engine's own bookkeeping is neither (the report's "other")
            s.stats.draft_time_s += (t1 - t0) + heard
            s.stats.verify_time_s += t2 - t1
        for s in [s for s in batch if s.finish_reason is not None]:
            self._leave(s, s.finish_reason)

    @staticmethod
    def _greedy_alone(batch: list[Sequence], plan: "_Plan") -> bool:
        """Whether only greedy acceptance reads this round's logits: every row greedy, with no
        penalty, logit bias, grammar, ``min_tokens`` hold (the processors) or logprobs."""
        return plan.ctx.counts is None and all(
            s.sampling.greedy and not s.sampling.penalized and s.grammar is None and not s.logit_bias
            and s.logprobs is None and s.min_tokens <= len(s.new_tokens) for s in batch)

    def _plan(self, batch: list[Sequence]) -> _Plan:
        """How far each row may draft this round (the length policy's choice, its budget and
        context left), the tree budget, and the drafter's context (with the penalties' counts)."""
        policy = self.policy(len(batch)) if self.adaptive and not self.never_drafts else None
        if policy is not None:
            policy.measure_costs = not any(s.fixed_draft_length for s in batch)
        want = policy.choose() if policy is not None else self.spec_length
        left = [min(s.max_new_tokens - len(s.new_tokens) - 1, s.max_len - len(s.tokens)) for s in batch]
        caps = [0 if self.never_drafts else min(self.spec_length if s.fixed_draft_length else want, n)
                for s, n in zip(batch, left)]
        predicted = {}
        for b, s in enumerate(batch):
            if s.prediction is not None:  # seeded sampling: a fixed length, the output a function of the seed
                most = self.spec_length if s.fixed_draft_length else s.prediction_policy.choose()
                tokens = s.prediction.draft(s.new_tokens, min(most, left[b]))
                if tokens:
                    predicted[b], caps[b] = tokens, len(tokens)
        plan = _Plan(self._context(batch), caps, policy, predicted)
        plan.ctx.tree_budget = self._tree_budget(policy, batch, plan.k)
        if plan.ctx.sampling.penalized:  # the penalties' context, shared by the drafter and the verify pass
            plan.ctx.counts = TokenCounts.of(plan.ctx.token_ids, plan.ctx.prompt_lengths, self.target.vocab_size,
                                             self.target.device)
        return plan

    def _commit(self, batch: list[Sequence], outcome: Outcome, logprobs: dict | None = None) -> list[int]:
        """Append each row's new tokens up to its first stop (:meth:`_round` sends them to its
        reader); the cache keeps them (a tree's path moved into place) and nothing after. Returns each row's count.
        ``logprobs``: row -> a TokenLogprob per committed token, kept for those appended."""
        committed, paths = [], []
        for b, s in enumerate(batch):
            before, start = len(s.tokens), s.cached
            s.stats.record_round(outcome.drafted[b], outcome.num_accepted[b], outcome.depths[b])
            for token in outcome.committed(b):
                s.tokens.append(token)
                s.finish_reason = self._finish_reason(s, token)
                if s.finish_reason:
                    break
            s.cached = len(s.tokens) - 1
            committed.append(len(s.tokens) - before)
            if logprobs and b in logprobs:  # before the event: its reader finds them there
                s.output_logprobs.extend(logprobs[b][: len(s.tokens) - before])
            if s.finish_reason is None and outcome.branched(b):
                paths.append((s.slot, start, outcome.paths[b]))
        live = [s for s in batch if s.finish_reason is None]
        if paths:
            self.runner.cache.keep_paths(paths)
        if live:
            self.runner.cache.set_lengths([s.cached for s in live], slots=[s.slot for s in live])
        return committed

    def _learn(self, batch: list[Sequence], plan: _Plan, proposal: Proposal, outcome: Outcome, draft_s: float,
               verify_s: float) -> None:
        """The length policies hear what the round cost and kept: the drafter's of its rows, each
        prediction's of its own (and the request's usage counts its predicted tokens)."""
        mine = [b for b in range(len(batch)) if b not in plan.predicted]
        if plan.policy is not None:
            tree_round = {"budget": plan.ctx.tree_budget} if getattr(self.drafter, "tree_budget", 1) > 1 else {}
            plan.policy.observe(proposal.width + 1, verify_s, [outcome.depths[b] for b in mine],
                                [outcome.num_accepted[b] for b in mine],
                                draft_seconds=draft_s if self._drafted_last and plan.k > 0 else None, **tree_round)
        for b in plan.predicted:
            drafted, accepted = outcome.drafted[b], outcome.num_accepted[b]
            batch[b].prediction_policy.observe(proposal.width + 1, verify_s, [drafted], [accepted])
            batch[b].stats.accepted_prediction_tokens += accepted
            batch[b].stats.rejected_prediction_tokens += drafted - accepted
        self._drafted_last = plan.k > 0

    def _report(self, plan: _Plan, outcome: Outcome, committed: list[int]) -> None:
        """The drafter hears what was verified and kept of its drafts (none of a row that drafted
        from its prediction), and, if it asks, the target's hidden states."""
        ctx, theirs = plan.ctx, [b not in plan.predicted for b in range(len(committed))]
        ctx.num_verified = [d if mine else 0 for d, mine in zip(outcome.drafted, theirs)]
        ctx.accepted_nodes = [p if mine else [] for p, mine in zip(outcome.paths, theirs)]
        if self.wants_hidden:  # the states of the positions whose next token is now known
            self._hand_hidden(ctx, [None if outcome.hidden is None else outcome.hidden_at(b, n)
                                    for b, n in enumerate(committed)])
        self._call("on_verified", ctx, [a if d else 0 for a, d in zip(outcome.num_accepted, ctx.num_verified)])

    def policy(self, rows: int) -> AdaptiveDraftLength:
        bucket = _rows_bucket(rows)
        if bucket not in self.policies:
            self.policies[bucket] = self.policy_class(self.spec_length)
        return self.policies[bucket]

    def _tree_budget(self, policy, batch, k: int) -> int:
        """Nodes the drafter may propose this round (``ctx.tree_budget``; 1 for a chain): the
        drafter's own ``tree_budget`` option, or what the policy finds pays at this batch size."""
        most = int(getattr(self.drafter, "tree_budget", 1) or 1)
        if most <= 1 or k <= 0 or not self.verifier.trees:
            return 1
        if policy is None or any(s.fixed_draft_length for s in batch):
            return most
        return policy.choose_budget(most, k)

    # -- joining and leaving ----------------------------------------------------------------

    def _join(self, joined: list[Sequence]) -> None:
        """Give the newcomers their cache rows and tell the drafter; their prompts wait to be prefilled."""
        if self.memory is not None:  # the prompts' room now, the rest as they grow (within their reservations)
            self.memory.fit(self.scheduler.running)
        else:
            self.runner.cache.reserve(max(s.max_len for s in joined) + self.spec_length + 1,
                                      rows=self.scheduler.max_batch)
        self.runner.cache.set_lengths([0] * len(joined), slots=[s.slot for s in joined])
        for s in joined:
            self._call("on_join", s.id, list(s.tokens))
            s.cached, s.prefix_block, s.filling_since = 0, None, self._prefill_steps
            self._filling.append(s)

    def _prefill(self) -> None:
        """Prefill the newcomers' prompts (all but each one's last token) in chunks of
        ``prefill_chunk`` tokens, at most one chunk's worth of tokens per step, the prompt with the
        fewest tokens left first, aged by how long it has waited (:meth:`_prefill_order`): a long prompt delays the running
        requests' next round by one chunk's pass, not by its whole prefill, and a request that
        arrives while it prefills waits one chunk's pass, not the rest of it, before its own
        prefill (a long prompt on an idle engine made short requests arriving after it wait 30 s
        for their first token).

        A chunk is ``prompt[i * chunk : (i + 1) * chunk]`` (offsets fixed by the prompt alone) in
        a pass of its own, never padded together with another prompt: a padded batch would round
        a row's keys and values by its batchmates' shapes (the products' blocking and attention's
        reductions follow the shape), so a request's output would depend on who joined with it (in
        bfloat16 it did: 2 of 4 greedy outputs changed). Passes the prefix cache holds are copied
        into the row instead (:meth:`_from_prefix_cache`), free of the step's budget."""
        chunk = self.prefill_chunk or PREFILL_BUDGET
        budget = chunk
        done: list[Sequence] = []
        if self.prefix is not None:  # what the cache holds first: the order below counts what is left to compute
            for s in list(self._filling):
                if s.prefilling:
                    self._guarded([s], self._from_prefix_cache)
        self._prefill_steps += 1
        queue = [(self._prefill_order(s), i, s) for i, s in enumerate(self._filling)]  # ties: first come first
        heapq.heapify(queue)
        while queue:
            _, i, s = queue[0]
            if s.prefilling and self.prefix is not None and budget < chunk:  # a pass this step may have kept its next
                self._guarded([s], self._from_prefix_cache)
            if s.prefilling:
                end = self._pass_end(s)
                size = end - s.cached
                if budget <= 0 or (size > budget and budget < chunk):
                    break  # the rest of this step's budget is less than the next chunk
                self._guarded([s], lambda _: self._prefill_chunk(s, end))
                budget -= size
            heapq.heappop(queue)
            if s.status is not Status.RUNNING:
                continue  # it failed, and left (and left the queue)
            if s.prefilling:
                heapq.heappush(queue, (self._prefill_order(s), i, s))
            else:
                done.append(s)
        if done:
            left = {id(s) for s in done}
            self._filling = [s for s in self._filling if id(s) not in left]
        if done and self.wants_hidden:
            rows = [s for s in self.scheduler.running if not s.prefilling]
            states = {s.id: torch.cat(s.prefill_states) if s.prefill_states else None for s in done}
            for s in done:
                s.prefill_states = []
            self._hand_hidden(self._context(rows), [states.get(s.id) for s in rows])

    def _prefill_order(self, s: Sequence) -> int:
        """Whose pass runs first (the least): the prompt tokens ``s`` has left to compute, less a
        chunk for every step it has waited, so a newcomer's short prompt goes before a long one's
        rest, and a long prompt that short ones keep overtaking still comes first in time (after
        about as many steps as it has chunks left). Ties: first come first (``min`` keeps the
        first)."""
        waited = self._prefill_steps - s.filling_since
        return (s.prompt_len - 1 - s.cached) - waited * (self.prefill_chunk or PREFILL_BUDGET)

    def _pass_end(self, s: Sequence) -> int:
        """Where ``s``'s next prefill pass ends: the next chunk boundary, or turn mark's end, or the
        prompt's end (all but its last token); offsets fixed by the prompt alone.

        A chat prompt ends with the generation prompt, and its last pass ends before that
        prompt's last token, just after the turn mark. A later turn of the conversation resends it
        with the answer and a new message after it: its pass also ends there, so every pass of the
        earlier prompt is one it has too, and the prefix cache holds them all (a boundary at fixed
        offsets only would leave the tail since the last one to compute again)."""
        last = s.prompt_len - 1
        end = min(last, (s.cached // self.prefill_chunk + 1) * self.prefill_chunk) if self.prefill_chunk else last
        if s.turn_ends is None:
            s.turn_ends = turn_ends(s.tokens[:last], self.turn_mark)
        return next((m for m in s.turn_ends if s.cached < m < end), end)

    def _from_prefix_cache(self, sequences: list[Sequence]) -> None:
        """Copy into ``s``'s row the passes of its prompt the prefix cache holds, in order from
        where it stands, up to the first it does not: each exactly the pass a prefill would run
        next (same offsets, same tokens before), so what the row holds is what prefilling gives."""
        [s] = sequences
        start, began = s.cached, time.perf_counter()
        while s.prefilling and (s.cached == 0 or s.prefix_block is not None):
            end = self._pass_end(s)
            block = self.prefix.find(s.prefix_block, s.tokens[s.cached : end])
            if block is None:
                break
            self.prefix.load(block, s.slot, s.cached)
            if block.hidden is not None:
                s.prefill_states.append(block.hidden)
            s.prefix_block, s.cached = block, end
        if s.cached > start:
            self.runner.cache.set_lengths([s.cached], slots=[s.slot])
            s.stats.cached_tokens += s.cached - start
            s.stats.prefill_time_s += time.perf_counter() - began

    def _prefill_chunk(self, s: Sequence, end: int) -> None:
        """One pass of ``s``'s prompt tokens ``cached:end`` into its cache row (and into the
        prefix cache, when it keeps the pass before)."""
        start, device = time.perf_counter(), self.target.device
        _, hidden = self.runner.forward(torch.tensor([s.tokens[s.cached : end]], device=device),
                                        logits_at=torch.zeros((1, 1), dtype=torch.long, device=device),
                                        hidden=self.wants_hidden, advance=[end - s.cached], slots=[s.slot])
        if hidden is not None:
            s.prefill_states.append(hidden[0])  # [end - prefilled, hidden_size]
        if self.prefix is not None and (s.cached == 0 or s.prefix_block is not None):
            s.prefix_block = self.prefix.save(s.prefix_block, s.tokens[s.cached : end], s.slot, s.cached,
                                              None if hidden is None else hidden[0])
        self._observe(prefill_report(s, end - s.cached, time.perf_counter() - start))
        s.cached = end
        s.stats.prefill_time_s += time.perf_counter() - start

    def _observe(self, report: StepReport) -> None:
        """Tell the observers (an observer's failure is logged once, never raised)."""
        if self.observers:
            notify(self.observers, report, self._failed_observers)

    def _guarded(self, sequences: list[Sequence], work) -> None:
        """``work(sequences)``; when it fails (a drafter's or the model's failure), only those requests fail."""
        try:
            work(sequences)
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - fails those requests only
            self._fail([s for s in sequences if s.status is Status.RUNNING], exc)

    def _fail(self, sequences: list[Sequence], exc: BaseException) -> None:
        """End ``sequences`` with ``exc``."""
        interrupted = isinstance(exc, KeyboardInterrupt)
        if not interrupted and not isinstance(exc, SpecdraftError):
            exc = SpecdraftError(f"generation failed: {type(exc).__name__}: {exc}")
        for s in sequences:
            if s.status is not Status.FINISHED:
                s.error = None if interrupted else exc
                self._leave(s, "interrupted" if interrupted else "error")

    def _leave(self, s: Sequence, reason: str) -> None:
        """``s`` leaves the batch: its slot is free for the next newcomer, the drafter forgets it."""
        if s in self._filling:
            self._filling.remove(s)
        if self.scheduler.release(s):
            try:
                self._call("on_leave", s.id)
            except DrafterError:
                pass  # the sequence is done either way; the drafter's next call will say more
        self._observe(finish_report(s, reason))
        s.finish(reason)

    def _context(self, rows: list[Sequence]) -> DraftContext:
        device = self.target.device
        generators = [s.generator(0, device) for s in rows]
        if self._shared is None:
            self._shared = torch.Generator(device=device)
        self._shared.manual_seed(mix_seed(*(g.initial_seed() for g in generators)))
        return DraftContext(
            token_ids=[s.tokens for s in rows],
            prompt_lengths=[s.prompt_len for s in rows],
            active=[s.status is Status.RUNNING for s in rows],
            vocab_size=self.target.vocab_size,
            device=device,
            sampling=RowSampling(s.sampling for s in rows),
            generator=self._shared,
            generators=generators,
            seq_ids=[s.id for s in rows],
        )

    def _generators(self, batch: list[Sequence]) -> list:
        """Each sampled row's verification generator (None for greedy rows)."""
        return [None if s.sampling.greedy else s.generator(1, self.target.device) for s in batch]

    def _rows(self, batch: list[Sequence]) -> list[RowState]:
        """What the logits processors read of each row."""
        eos, rows = self.target.eos_token_ids, []
        for s in batch:
            produced = len(s.new_tokens)
            # the end tokens matter to a row still short of min_tokens, or with a grammar
            held = s.early_stops(eos) if s.grammar is not None or s.min_tokens > produced else ()
            rows.append(RowState(produced=produced, min_tokens=s.min_tokens, held=held, logit_bias=s.logit_bias,
                                 matcher=s.grammar, ends=frozenset(held)))
        return rows

    @staticmethod
    def _grammar_failures(batch: list[Sequence]) -> None:
        """A row whose grammar engine failed ends with its message (its masks allowed only its end)."""
        for s in batch:
            if s.grammar is not None and s.grammar.error is not None and s.error is None:
                s.error = SpecdraftError(f"structured output failed (the grammar engine stopped): {s.grammar.error}")

    def _finish_reason(self, s: Sequence, token: int) -> str | None:
        """Why ``s`` ends after ``token`` (None: it goes on). Before ``min_tokens`` outputs only the
        length limits end it (EOS and the stop tokens cannot come, stop strings do not count)."""
        n = len(s.new_tokens)
        # a grammar that allows nothing but its end lets the end tokens through before min_tokens too
        if n >= s.min_tokens or (s.grammar is not None and token in s.early_stops(self.target.eos_token_ids)):
            if token in self.target.eos_token_ids and not s.ignore_eos:
                return "eos"
            if token in s.stop_token_ids:
                return "stop"
            if s.stop and self._stop_string(s):
                return "stop"
        if n >= s.max_new_tokens or len(s.tokens) >= s.max_len:
            return "length"
        return None

    def _stop_string(self, s: Sequence) -> bool:
        """Whether a stop string ends in the text of ``s``'s newest token (or later in its window):
        the tail of the output is decoded; while that tail reaches back before ``min_tokens``, the
        whole output is, and only stop strings ending past :func:`stop_floor` count."""
        tokenizer, output = self.target.tokenizer, s.new_tokens
        window = max(len(x) for x in s.stop) + 4  # every token decodes to >= 1 character
        if s.min_tokens > 1 and len(output) - window < s.min_tokens - 1:
            text = tokenizer.decode(output, skip_special_tokens=True)
            return first_stop(text, s.stop, stop_floor(tokenizer, output, s.min_tokens)) is not None
        return first_stop(tokenizer.decode(output[-window:], skip_special_tokens=True), s.stop) is not None

    # -- the drafter ----------------------------------------------------------------------

    @property
    def wants_hidden(self) -> bool | tuple[int, ...]:
        """What the target's passes return for the drafter: nothing (False), the final-norm
        states (True) or the states of the layers it names (``hidden_layers``)."""
        if not getattr(self.drafter, "needs_hidden_states", False):
            return False
        layers = getattr(self.drafter, "hidden_layers", None)
        return tuple(int(i) for i in layers) if layers else True

    def _hand_hidden(self, ctx: DraftContext, states: list) -> None:
        """Give the drafter ``states[b] # [n_b, dim]`` for each row (empty where None)."""
        width = next((h.shape[-1] for h in states if h is not None), None)
        if width is None:
            layers = self.wants_hidden
            width = int(self.target.hidden_size or 0) * (len(layers) if isinstance(layers, tuple) else 1)
        empty = torch.zeros((0, width), dtype=self.target.dtype, device=self.target.device)
        # a quantized runner computes in bfloat16; drafters get the target's dtype
        rows = [empty if h is None else h.to(self.target.dtype) for h in states]
        self._call("on_hidden_states", ctx, rows)

    def _call(self, method: str, *args):
        start = time.perf_counter()
        try:
            return getattr(self._drafting, method)(*args)
        except SpecdraftError:
            raise
        except Exception as exc:  # noqa: BLE001 - a drafter's own failure, named
            raise DrafterError(
                f"drafter {self.verifier.who} raised {type(exc).__name__} in {method}(): {exc}"
            ) from exc
        finally:
            self._drafter_s += time.perf_counter() - start


def release_openmp_workers() -> None:
    """Free the calling thread's OpenMP worker threads (``omp_pause_resource_all``); torch makes
    new ones at this thread's next parallel operation.

    Why: GNU OpenMP (torch's on Linux) gives each thread that starts parallel work a pool of
    workers, and once it manages more threads than there are CPUs its workers stop spin-waiting
    between parallel regions, so every region pays a wake-up. A process that loads a model on
    its main thread and decodes on the engine's thread has two pools. Measured on a 2-core AMD
    EPYC: a oneDNN product took 85 us from the engine's thread against 36 us from the main
    thread, and a one-token step 28-30 ms against 15-17 ms; with the submitting thread's pool
    freed, the engine's thread ran as fast as the main thread. A no-op where the runtime has no
    such function."""
    if _OMP_PAUSE is not None:
        _OMP_PAUSE(1)  # omp_pause_soft: this thread's pool only; -1 (ignored) inside a parallel region


def _find_omp_pause():
    import ctypes

    try:
        return ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):
        return None


_OMP_PAUSE = _find_omp_pause()


class EngineLoop:
    """Steps an :class:`Engine` on a thread of its own while it has work: callers on any thread
    submit sequences and read each one's ``events``; their sequences batch together. The thread
    ends when the work does (the next submit starts another), so an idle thread never keeps a
    dropped decoder's engine, cache and drafter alive. It runs with the submitting thread's
    torch thread count (a thread's OpenMP settings are its own), and a submit frees the
    submitting thread's OpenMP workers (:func:`release_openmp_workers`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.wake = threading.Condition()
        self.step_lock = threading.Lock()  # held while a step runs (warm-up waits for it)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._threads = torch.get_num_threads()
        _LOOPS.add(self)

    def submit(self, sequences: list[Sequence], limit: bool = True) -> None:
        if threading.current_thread() is not self._thread:
            self._threads = torch.get_num_threads()
            release_openmp_workers()
        with self.wake:
            if self._stopping:
                raise SpecdraftError("this decoder has been closed")
            self.engine.add(sequences, limit=limit)
            if self._thread is None:  # the last one ended (under this lock) with nothing to do
                self._thread = threading.Thread(target=self._run, name="specdraft-engine", daemon=True)
                self._thread.start()
            self.wake.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything, then end the thread (after its current step)."""
        with self.wake:
            self._stopping = True
            for seq in list(self.engine.scheduler.waiting) + list(self.engine.scheduler.running):
                self.engine.abort(seq)
            self.wake.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def abort(self, seq: Sequence) -> None:
        self.engine.abort(seq)
        with self.wake:
            self.wake.notify()

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        while True:
            with self.wake:
                if not self.engine.has_work() or (self._stopping and not self.engine.num_running):
                    self._thread = None  # under the lock: a submit from now on starts a new thread
                    return
            with self.step_lock:
                self.engine.step()


#: every loop, stopped at interpreter exit: a thread still inside torch then would abort the process
_LOOPS: "weakref.WeakSet[EngineLoop]" = weakref.WeakSet()


@atexit.register
def _stop_loops() -> None:
    for loop in list(_LOOPS):
        loop.stop(timeout=5.0)


__all__ = ["Engine", "EngineLoop", "release_openmp_workers"]
