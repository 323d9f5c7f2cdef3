"""Who runs: the waiting queue, the running batch and the target cache's rows (slots)."""

from __future__ import annotations

import threading
import time
from collections import deque

from ..errors import QueueFull
from .sequence import Sequence, Status

class Scheduler:
    """First come, first served: at most ``max_batch`` sequences run, each holding a row of the
    target's cache (its slot) while it runs, from the step that admits it (prefilling its prompt,
    chunk by chunk: the engine's business) to its end. ``waves``: newcomers wait until the running batch is
    empty (an API-version-1 drafter's waves). ``add`` and ``abort`` may be called from any thread;
    the rest from the engine's."""

    def __init__(self, max_batch: int, max_waiting: int | None = None, waves: bool = False) -> None:
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.waves = waves
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in slot order: a full batch is then a pass over the cache's own buffers
        self.free_slots = list(range(max_batch))
        self.lock = threading.Lock()  # the queue, the free slots and abort flags, shared with callers' threads

    def add(self, sequences: list[Sequence], limit: bool = True) -> None:
        """Queue ``sequences``; QueueFull (none queued) when ``limit`` and the waiting queue is full."""
        with self.lock:
            # requests a free slot will take at the next step do not count as waiting; when nothing
            # else waits, a request comes in whatever its size (its n choices may outnumber the
            # queue: refused then, it would be refused on an idle server forever)
            queued = len(self.waiting) + len(sequences) - len(self.free_slots)
            others = len(self.waiting) - len(self.free_slots)
            if limit and self.max_waiting is not None and queued > self.max_waiting and others > 0:
                # (len(self.waiting) would mislead: it counts requests a free slot takes at the next step)
                raise QueueFull(f"the server is busy: its queue of {self.max_waiting} waiting requests is full; "
                                "retry later")
            self.waiting.extend(sequences)

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq``: a waiting one at once, a running one at the start of the next step (:meth:`aborted`)."""
        with self.lock:
            if seq.status is Status.FINISHED:
                return
            seq.aborted = True
            if seq.status is Status.WAITING:
                self.waiting.remove(seq)
                seq.finish("aborted")

    def aborted(self) -> list[Sequence]:
        """Running sequences whose caller aborted them: they leave now."""
        return [s for s in self.running if s.aborted]

    def admit(self, admission=None) -> list[Sequence]:
        """Waiting sequences that get a slot this step (they join the running batch), first come
        first served; ``admission(running)``, when given, makes the check ``fits(seq, slot)`` of
        whether ``seq`` may join in ``slot`` beside the running ones and those joining before it
        (the KV cache's memory, :meth:`~specdraft.engine.memory.KVMemory.admission`: else it and
        those behind it wait)."""
        joined: list[Sequence] = []
        with self.lock:
            if self.waves and self.running:
                return joined  # a wave runs to its end before the next starts
            fits = None if admission is None else admission(self.running)
            while self.waiting and self.free_slots:
                if fits is not None and not fits(self.waiting[0], self.free_slots[0]):
                    break
                seq = self.waiting.popleft()
                seq.slot = self.free_slots.pop(0)
                seq.status = Status.RUNNING
                seq.admitted = time.perf_counter()
                joined.append(seq)
        self.running = sorted(self.running + joined, key=lambda s: s.slot)
        return joined

    def release(self, seq: Sequence) -> bool:
        """``seq`` leaves the batch and frees its slot; whether it was running."""
        was_running = seq in self.running
        if was_running:
            self.running.remove(seq)
        if seq.slot is not None:
            with self.lock:
                self.free_slots.append(seq.slot)
                self.free_slots.sort()
            seq.slot = None
        return was_running

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
