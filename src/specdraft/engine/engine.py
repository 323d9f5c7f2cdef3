"""The engine: continuous batching of speculative decoding.

One step, for the sequences running in it (each holds a row of the target's cache, its slot)::

    schedule  retire aborted sequences; admit waiting ones into free slots and prefill them
    propose   d_1..d_k'          <- drafter.propose(ctx, k)          (k' <= k, per sequence)
    verify    logits             <- target([last, d_1..d_k'])        one pass over the running slots
    accept    n, next            <- greedy_accept / rejection_sample (per sequence: its settings,
                                                                      its own generator)
    commit    emit d_1..d_n, next (stop conditions token by token); cache length += n + 1;
              finished sequences leave at once and free their slot

The cache holds every token of a sequence but its last one, which is fed first in the next
round. A round where nobody drafted anything is a plain one-token decoding step.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque

import torch

from ..errors import DrafterError, QueueFull, SpecdraftError
from ..sampling import RowSampling, TokenCounts, greedy_tokens, logits_to_probs
from ..types import DraftContext, TargetInfo
from .policy import AdaptiveDraftLength
from .rejection import (first_chain, greedy_accept, greedy_tree_accept, rejection_sample, tree_ancestors,
                        tree_rejection_sample)
from .sequence import Sequence, Status, mix_seed
from .verify import DEBUG, check_draft

#: Prompt tokens one step prefills at most (the first newcomer is always admitted).
PREFILL_BUDGET = 4096


def _rows_bucket(rows: int) -> int:
    """Batch sizes that share a draft-length policy (verify costs depend on the batch)."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return bucket


class Engine:
    """Runs speculative decoding of the target's ``runner`` with ``drafter`` for sequences that
    join and leave between steps. ``add`` and ``abort`` may be called from any thread; ``step``
    from one thread at a time (:class:`EngineLoop` does)."""

    def __init__(self, runner, drafter, target: TargetInfo, spec_length: int, adaptive: bool = True,
                 max_batch: int = 8, max_waiting: int | None = None) -> None:
        self.runner = runner  # specdraft.runner: ModelRunner or TransformersRunner
        self.drafter = drafter
        self.target = target
        self.spec_length = spec_length
        self.adaptive = adaptive
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        #: draft-length policies per batch-size bucket: verify costs differ with the batch
        self.policies: dict[int, AdaptiveDraftLength] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        #: API-version-1 drafters: the wave of sequences the drafter knows, by row index
        self.wave: list[Sequence] = []
        self.per_sequence = getattr(drafter, "api_version", 1) >= 2
        self.free_slots = list(range(max_batch))
        self.lock = threading.Lock()  # the queues and abort flags, shared with callers' threads
        # Full value checks of every draft cost device-to-host copies; free on CPU.
        self.validate_drafts = DEBUG or torch.device(target.device).type == "cpu"
        self._drafted_last = False
        self._shared: torch.Generator | None = None  # the round's one generator (``ctx.generator``)
        self.reset_cache()

    def reset_cache(self) -> None:
        """An empty target cache with a row per slot (nothing may be running)."""
        self.runner.reset(self.max_batch, 256)

    # -- requests (any thread) ------------------------------------------------------------

    def add(self, sequences: list[Sequence], limit: bool = True) -> None:
        """Queue ``sequences``; QueueFull (none queued) when ``limit`` and the waiting queue is full."""
        with self.lock:
            # requests a free slot will take at the next step do not count as waiting
            queued = len(self.waiting) + len(sequences) - len(self.free_slots)
            if limit and self.max_waiting is not None and queued > self.max_waiting:
                raise QueueFull(f"the server is busy: {len(self.waiting)} requests are waiting (at most "
                                f"{self.max_waiting}); retry later")
            self.waiting.extend(sequences)

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq``: a waiting one at once, a running one at the start of the next step."""
        with self.lock:
            if seq.status is Status.FINISHED:
                return
            seq.aborted = True
            if seq.status is Status.WAITING:
                self.waiting.remove(seq)
                self._finish(seq, "aborted")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step -------------------------------------------------------------------------

    def policy(self, rows: int) -> AdaptiveDraftLength:
        bucket = _rows_bucket(rows)
        if bucket not in self.policies:
            self.policies[bucket] = AdaptiveDraftLength(self.spec_length)
        return self.policies[bucket]

    def step(self) -> None:
        """Schedule, then one round of draft -> verify -> accept -> commit for the running sequences."""
        with torch.inference_mode():
            self._retire_aborted()
            joined = self._admit()
            if joined:
                try:
                    self._join(joined)
                except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - fails those requests only
                    self._fail(joined, exc)
            if not self.running:
                return
            batch = list(self.running)
            try:
                self._round(batch)
            except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - fails those requests only
                self._fail([s for s in batch if s.status is Status.RUNNING], exc)

    def _round(self, batch: list[Sequence]) -> None:
        target, device, runner = self.target, self.target.device, self.runner
        now = time.perf_counter
        t0 = now()
        rows = self._drafter_rows()
        ctx = self._context(rows)
        where = {s.id: i for i, s in enumerate(rows)}
        index = [where[s.id] for s in batch]  # drafter row of each batch row
        policy = self.policy(len(batch)) if self.adaptive else None
        if policy is not None:
            policy.measure_costs = not any(s.fixed_draft_length for s in batch)
        want = policy.choose() if policy is not None else self.spec_length
        caps = [min(self.spec_length if s.fixed_draft_length else want, s.max_new_tokens - len(s.new_tokens) - 1,
                    s.max_len - len(s.tokens)) for s in batch]
        k = max(caps)
        ctx.tree_budget = self._tree_budget(policy, batch, k)
        if ctx.sampling.penalized:  # the penalties' context, shared by the drafter and the verify pass
            ctx.counts = TokenCounts.of(ctx.token_ids, ctx.prompt_lengths, target.vocab_size, device)
        tree = None  # (parents, valid, ancestors, depths) when the draft is a tree
        if k > 0:
            draft = self._call("propose", ctx, k)
            ids, lengths, probs, parents = check_draft(draft, len(rows), k, target.vocab_size, self._label, device,
                                                       full=self.validate_drafts)
            if len(rows) != len(batch) or index != list(range(len(batch))):  # finished wave rows
                pick = torch.tensor(index, device=device)
                ids, lengths = ids[pick], lengths[pick]
                probs = None if probs is None else probs[pick]
                parents = None if parents is None else parents[pick]
            caps_t = torch.tensor(caps, device=device)
            if parents is not None and ids.shape[1] == 0:  # an empty tree is an empty chain
                parents = None
            if parents is not None:
                ancestors, valid, depths = tree_ancestors(parents, lengths, max_depth=caps_t)
                if not getattr(runner, "supports_tree", False):  # verify its first chain instead
                    ids, lengths, probs = first_chain(ids, parents, valid, probs)
                    parents = None
            if parents is None:
                lengths = torch.minimum(lengths, caps_t)
                used = lengths
            else:
                used = torch.where(valid, torch.arange(ids.shape[1], device=device) + 1, 0).max(1).values
            # no wider a pass than the largest draft: free to know on a CPU, a copy on a GPU
            width = int(used.max()) if used.device.type == "cpu" and used.numel() else ids.shape[1]
            ids = ids[:, :width]
            probs = probs[:, :width] if probs is not None else None
            if parents is not None:
                lengths = valid[:, :width].sum(1)
                if width:  # else nothing valid was drafted: a plain step
                    tree = (parents[:, :width], valid[:, :width], ancestors[:, : width + 1, : width + 1],
                            depths[:, :width])
        else:
            ids = torch.zeros((len(batch), 0), dtype=torch.long, device=device)
            lengths = torch.zeros(len(batch), dtype=torch.long, device=device)
            probs = None
        width = ids.shape[1]
        t1 = now()

        last = torch.tensor([[s.tokens[-1]] for s in batch], device=device)  # [batch, 1]
        slots = [s.slot for s in batch]
        runner.reserve(max(s.cached for s in batch) + width + 1)
        shape = {} if tree is None else {"tree_mask": tree[2],
                                         "depths": torch.cat([torch.zeros_like(last), tree[3]], 1)}
        logits, hidden = runner.forward(torch.cat([last, ids], dim=1), hidden=self.wants_hidden, slots=slots, **shape)
        # logits [batch, width+1, vocab], hidden [batch, width+1, dim] | None
        counts = None
        if ctx.counts is not None:
            mine = ctx.counts.select(torch.tensor(index))
            counts = mine.along(ids) if tree is None else mine.along_tree(ids, tree[2])
        num_accepted, next_token, path = self._accept(batch, ids, lengths, probs, logits, counts, tree)
        depth = lengths if tree is None else tree[3].max(1).values
        kept = ids.gather(1, path.clamp(max=max(width - 1, 0))) if width else path  # the accepted tokens
        # the round's one copy to the host: [accepted, next token, drafted, depth, path..., tokens...] per row
        summary = torch.cat([num_accepted[:, None], next_token[:, None], lengths[:, None], depth[:, None], path, kept],
                            dim=1).tolist()
        t2 = now()

        committed, accepted, drafted = [0] * len(rows), [0] * len(rows), [0] * len(rows)
        paths: list[list[int]] = [[] for _ in rows]
        finished, moves = [], []
        for b, s in enumerate(batch):
            n, token, d, levels = summary[b][:4]
            chosen, tokens = summary[b][4 : 4 + width][:n], summary[b][4 + width :][:n]
            r = index[b]
            accepted[r], drafted[r], paths[r] = n, d, chosen
            before, start = len(s.tokens), s.cached
            s.stats.record_round(d, n, levels)
            for token in tokens + [token]:
                s.tokens.append(token)
                reason = self._finish_reason(s, token)
                if reason:
                    s.finish_reason = reason
                    finished.append(s)
                    break
            s.cached = len(s.tokens) - 1
            committed[r] = len(s.tokens) - before
            if s.finish_reason is None and chosen != list(range(n)):  # a branch off the first-drafted line
                moves.append((s.slot, [start + 1 + j for j in chosen], [start + 1 + m for m in range(n)]))
        live = [s for s in batch if s.finish_reason is None]
        if moves:
            self._keep_paths(moves)
        if live:
            runner.set_lengths([s.cached for s in live], slots=[s.slot for s in live])
        if policy is not None:
            tree_round = {"budget": ctx.tree_budget} if getattr(self.drafter, "tree_budget", 1) > 1 else {}
            policy.observe(width + 1, t2 - t1, [summary[b][3] for b in range(len(batch))],
                           [summary[b][0] for b in range(len(batch))],
                           draft_seconds=(t1 - t0) if self._drafted_last and k > 0 else None, **tree_round)
        self._drafted_last = k > 0
        ctx.num_verified = drafted
        ctx.accepted_nodes = paths
        if self.wants_hidden:  # the states of the positions whose next token is now known
            states = [None] * len(rows)
            for b in range(len(batch)):
                r = index[b]
                if hidden is not None:
                    at = torch.tensor([0] + [j + 1 for j in paths[r]][: committed[r] - 1], device=device)
                    states[r] = hidden[b, at]
            self._hand_hidden(ctx, states)
        self._call("on_verified", ctx, [a if d else 0 for a, d in zip(accepted, drafted)])
        t3 = now()
        for b, s in enumerate(batch):
            s.stats.draft_time_s += (t1 - t0) + (t3 - t2)
            s.stats.verify_time_s += t2 - t1
            s.events.put(("tokens", s.tokens[len(s.tokens) - committed[index[b]]:]))
        for s in finished:
            self._retire(s)

    def _keep_paths(self, moves: list[tuple[int, list[int], list[int]]]) -> None:
        """Move each tree's accepted path into place in the target's cache: ``(slot, from, to)`` positions."""
        width = max(len(src) for _, src, _ in moves)

        def tail(dst: list[int]) -> list[int]:  # padding: positions moved onto themselves
            return [dst[-1] + 1 + m for m in range(width - len(dst))]

        src = [a + tail(b) for _, a, b in moves]
        dst = [b + tail(b) for _, _, b in moves]
        device = self.target.device
        self.runner.move(torch.tensor(src, device=device), torch.tensor(dst, device=device), slots=[m[0] for m in moves])

    def _tree_budget(self, policy, batch, k: int) -> int:
        """Nodes the drafter may propose this round (``ctx.tree_budget``; 1 for a chain): the
        drafter's own ``tree_budget`` option, or what the policy finds pays at this batch size."""
        most = int(getattr(self.drafter, "tree_budget", 1) or 1)
        if most <= 1 or k <= 0 or not getattr(self.runner, "supports_tree", False):
            return 1
        if policy is None or any(s.fixed_draft_length for s in batch):
            return most
        return policy.choose_budget(most, k)

    def _accept(self, batch, ids, lengths, probs, logits, counts, tree=None):
        """Each sequence's accepted count, next token and accepted nodes ``# [batch], [batch],
        [batch, width]``: greedy rows together, sampled rows one by one with their own settings and
        generator (float32 or wider). ``tree``: the draft is a tree (see :meth:`_round`)."""
        device = logits.device
        batch_size, width = ids.shape
        params = RowSampling(s.sampling for s in batch)
        greedy = [b for b, s in enumerate(batch) if s.sampling.greedy]
        chain = torch.arange(width, device=device).expand(batch_size, width)

        def greedy_rows(rows: list[int] | None):
            pick = slice(None) if rows is None else torch.tensor(rows, device=device)
            wanted = greedy_tokens(logits[pick], params if rows is None else RowSampling(params[b] for b in rows),
                                   None if counts is None else counts.select(pick))
            if tree is None:
                n, t = greedy_accept(ids[pick], lengths[pick], wanted)
                return n, t, chain[pick]
            return greedy_tree_accept(ids[pick], tree[0][pick], tree[1][pick], wanted)

        if len(greedy) == len(batch):
            return greedy_rows(None)
        num_accepted = torch.zeros(batch_size, dtype=torch.long, device=device)
        next_token = torch.zeros(batch_size, dtype=torch.long, device=device)
        path = torch.full((batch_size, width), width, dtype=torch.long, device=device)
        if greedy:
            g = torch.tensor(greedy, device=device)
            num_accepted[g], next_token[g], path[g] = greedy_rows(greedy)
        drafted = lengths.tolist()
        for b, s in enumerate(batch):
            if s.sampling.greedy:
                continue
            generator = s.generator(1, device)
            if tree is not None:  # the row's own valid nodes only: its draws do not depend on the pass's width
                row_counts = None if counts is None else counts.select(slice(b, b + 1))
                target_probs = logits_to_probs(logits[b : b + 1], s.sampling, row_counts)[0]
                nodes, t = tree_rejection_sample(ids[b], tree[0][b], tree[1][b], None if probs is None else probs[b],
                                                 target_probs, generator)
                num_accepted[b], next_token[b] = len(nodes), t
                path[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
                continue
            d = drafted[b]  # the row's own draft only: its random draws do not depend on the pass's width
            row_counts = None if counts is None else TokenCounts(counts.in_context[b : b + 1, : d + 1],
                                                                 counts.in_output[b : b + 1, : d + 1])
            target_probs = logits_to_probs(logits[b : b + 1, : d + 1], s.sampling, row_counts)
            n, t = rejection_sample(ids[b : b + 1, :d], lengths[b : b + 1], None if probs is None else probs[b : b + 1, :d],
                                    target_probs, generator)
            num_accepted[b], next_token[b] = n[0], t[0]
            path[b] = chain[b]
        return num_accepted, next_token, path

    # -- scheduling -----------------------------------------------------------------------

    def _admit(self) -> list[Sequence]:
        """Waiting sequences that get a slot this step (first come, first served)."""
        joined: list[Sequence] = []
        with self.lock:
            if not self.per_sequence and self.running:
                return joined  # an API-1 drafter's wave runs to its end before the next starts
            budget = PREFILL_BUDGET
            while self.waiting and self.free_slots:
                seq = self.waiting[0]
                if joined and seq.prompt_len > budget:
                    break
                self.waiting.popleft()
                budget -= seq.prompt_len
                seq.slot = self.free_slots.pop(0)
                seq.status = Status.RUNNING
                joined.append(seq)
        return joined

    def _join(self, joined: list[Sequence]) -> None:
        """Give the newcomers their cache rows, tell the drafter, prefill their prompts."""
        runner, device = self.runner, self.target.device
        runner.reserve(max(s.max_len for s in joined) + self.spec_length + 1, rows=self.max_batch)
        runner.set_lengths([0] * len(joined), slots=[s.slot for s in joined])
        # in slot order: a full batch is then every slot in order, a pass over the cache's own
        # buffers (out of order, every pass gathered the rows' buffers in every layer)
        self.running = sorted(self.running + joined, key=lambda s: s.slot)
        if self.per_sequence:
            for s in joined:
                self._call("on_join", s.id, list(s.tokens))
        else:
            self.wave = list(self.running)
            self._call("reset")
        start = time.perf_counter()
        # Prefill everything but each prompt's last token (right-padded; padding is never read).
        longest = max(s.prompt_len for s in joined) - 1
        hidden = None
        if longest > 0:
            prefill = torch.zeros((len(joined), longest), dtype=torch.long)
            for b, s in enumerate(joined):
                prefill[b, : s.prompt_len - 1] = torch.tensor(s.tokens[: s.prompt_len - 1])
            _, hidden = runner.forward(prefill.to(device), logits_at=torch.zeros((len(joined), 1), dtype=torch.long,
                                                                                 device=device),
                                       hidden=self.wants_hidden, advance=[s.prompt_len - 1 for s in joined],
                                       slots=[s.slot for s in joined])
        for s in joined:
            s.cached = s.prompt_len - 1
        if self.wants_hidden:  # [joined, longest, hidden_size]
            rows = self._drafter_rows()
            where = {s.id: b for b, s in enumerate(joined)}
            states = [hidden[where[s.id], : s.prompt_len - 1] if s.id in where and hidden is not None else None
                      for s in rows]
            self._hand_hidden(self._context(rows), states)
        took = time.perf_counter() - start
        for s in joined:
            s.stats.prefill_time_s += took

    def _drafter_rows(self) -> list[Sequence]:
        """The sequences the drafter sees, in row order: the running ones, or an API-1 drafter's wave."""
        return list(self.running) if self.per_sequence else list(self.wave)

    def _context(self, rows: list[Sequence]) -> DraftContext:
        device = self.target.device
        running = [s.status is Status.RUNNING for s in rows]
        generators = [s.generator(0, device) for s in rows]
        if self._shared is None:
            self._shared = torch.Generator(device=device)
        self._shared.manual_seed(mix_seed(*(g.initial_seed() for g in generators)))
        return DraftContext(
            token_ids=[s.tokens for s in rows],
            prompt_lengths=[s.prompt_len for s in rows],
            active=running,
            vocab_size=self.target.vocab_size,
            device=device,
            sampling=RowSampling(s.sampling for s in rows),
            generator=self._shared,
            generators=generators,
            seq_ids=[s.id for s in rows],
        )

    def _finish_reason(self, s: Sequence, token: int) -> str | None:
        if token in self.target.eos_token_ids:
            return "eos"
        if s.stop:
            window = max(len(x) for x in s.stop) + 4  # every token decodes to >= 1 character
            tail = self.target.tokenizer.decode(s.new_tokens[-window:], skip_special_tokens=True)
            if any(x in tail for x in s.stop):
                return "stop"
        if len(s.new_tokens) >= s.max_new_tokens or len(s.tokens) >= s.max_len:
            return "length"
        return None

    def _retire_aborted(self) -> None:
        for s in [s for s in self.running if s.aborted]:
            s.finish_reason = "aborted"
            self._retire(s)

    def _retire(self, s: Sequence) -> None:
        """``s`` leaves the batch: its slot is free for the next newcomer."""
        if s in self.running:
            self.running.remove(s)
            if self.per_sequence:
                try:
                    self._call("on_leave", s.id)
                except DrafterError:
                    pass  # the sequence is done either way; the drafter's next call will say more
            elif not self.running:
                self.wave = []
        if s.slot is not None:
            with self.lock:
                self.free_slots.append(s.slot)
                self.free_slots.sort()
            s.slot = None
        self._finish(s, s.finish_reason or "aborted")

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finish_reason = reason
        s.status = Status.FINISHED
        s.stats.new_tokens = len(s.new_tokens)
        s.stats.total_time_s = time.perf_counter() - s.submitted
        s.events.put(("done", None))

    def _fail(self, sequences: list[Sequence], exc: BaseException) -> None:
        """End ``sequences`` with ``exc`` (a drafter's or the model's failure): only those requests fail."""
        interrupted = isinstance(exc, KeyboardInterrupt)
        if not interrupted and not isinstance(exc, SpecdraftError):
            exc = SpecdraftError(f"generation failed: {type(exc).__name__}: {exc}")
        for s in sequences:
            if s.status is Status.FINISHED:
                continue
            s.error = None if interrupted else exc
            s.finish_reason = "interrupted" if interrupted else "error"
            self._retire(s)
        if not self.per_sequence and not self.running:
            self.wave = []

    # -- the drafter ----------------------------------------------------------------------

    @property
    def wants_hidden(self) -> bool:
        return bool(getattr(self.drafter, "needs_hidden_states", False))

    def _hand_hidden(self, ctx: DraftContext, states: list) -> None:
        """Give the drafter ``states[b] # [n_b, dim]`` for each row (empty where None)."""
        width = int(self.target.hidden_size or next((h.shape[-1] for h in states if h is not None), 0))
        empty = torch.zeros((0, width), dtype=self.target.dtype, device=self.target.device)
        # a quantized runner computes in bfloat16; drafters get the target's dtype
        rows = [empty if h is None else h.to(self.target.dtype) for h in states]
        self._call("on_hidden_states", ctx, rows)

    @property
    def _label(self) -> str:
        name = getattr(self.drafter, "name", "") or type(self.drafter).__name__
        plugin = getattr(self.drafter, "plugin", "")
        return f"{name!r}" + (f" (plugin {plugin!r})" if plugin else "")

    def _call(self, method: str, *args):
        try:
            return getattr(self.drafter, method)(*args)
        except SpecdraftError:
            raise
        except Exception as exc:  # noqa: BLE001 - a drafter's own failure, named
            raise DrafterError(
                f"drafter {self._label} raised {type(exc).__name__} in {method}(): {exc}"
            ) from exc


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
            for seq in list(self.engine.waiting) + list(self.engine.running):
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
                if not self.engine.has_work() or (self._stopping and not self.engine.running):
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
