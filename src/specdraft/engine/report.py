"""What the engine tells its observers as it goes: :class:`StepReport`, one per round, per prefill
pass and per sequence that leaves.

``Engine.observers`` is a list of callables, each called with every report on the engine's own
thread (keep them quick: a step waits for them). A round's report comes after its tokens are
committed and before they are sent to their readers, so whoever has received tokens finds them
counted already; a sequence's ``"finish"`` report comes before its reader hears it is done. An
observer that raises is logged once and otherwise ignored: metrics never stop decoding.

Times are :func:`time.perf_counter` readings, the clock of ``Sequence.submitted``: a sequence is
stamped when it is admitted (``admitted``, by the scheduler), and when its first and latest
bursts of output are committed (``first_token``, ``last_token``, by :func:`round_report`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from .sequence import Sequence

logger = logging.getLogger("specdraft.engine")


@dataclass(frozen=True)
class RowReport:
    """What one report says of one sequence (a round's row, a prefill pass's or a leaving one's)."""

    seq: Sequence
    #: output tokens this round appended (its reader's burst; 1..K+1 in a round, else 0)
    committed: int = 0
    #: draft tokens the target verified for it (a tree's nodes) and how many it accepted
    drafted: int = 0
    accepted: int = 0
    #: levels of its draft verified (a chain: its length; a tree: its depth)
    depth: int = 0
    #: it drafted from its request's prediction (Predicted Outputs), not from the drafter
    predicted: bool = False
    #: prompt tokens a prefill pass put into its cache row
    prefilled: int = 0
    #: seconds since its previous burst (None: this round gave its first output tokens)
    gap: float | None = None

    @property
    def first(self) -> bool:
        """This round gave the sequence its first output tokens (its prompt's prefill is complete)."""
        return self.committed > 0 and self.gap is None

    @property
    def accepted_per_position(self) -> list[int]:
        """``[depth]`` 1 where the draft's token at that position (0 = first) was accepted."""
        return [1] * self.accepted + [0] * max(0, self.depth - self.accepted)


@dataclass(frozen=True)
class StepReport:
    """One round (``kind="round"``: a verify pass over ``rows``), one prefill pass
    (``"prefill"``: one row, its ``prefilled`` tokens) or one sequence leaving the engine
    (``"finish"``: one row; ``reason`` its finish reason: ``"eos"``, ``"stop"``, ``"length"``,
    ``"aborted"``, ``"error"``, ``"interrupted"``)."""

    kind: Literal["round", "prefill", "finish"]
    rows: list[RowReport]
    time: float = field(default_factory=time.perf_counter)  # when it was reported
    draft_s: float = 0.0  # a round's drafting (the drafter's propose and the proposal's checks)
    verify_s: float = 0.0  # a round's verify pass and acceptance
    prefill_s: float = 0.0  # a prefill pass
    reason: str | None = None

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def tokens(self) -> int:
        """Tokens this report's pass produced: a round's committed output, a prefill pass's prompt tokens."""
        return sum(r.committed + r.prefilled for r in self.rows)


Observer = Callable[[StepReport], None]


def round_report(batch: list[Sequence], outcome, committed: list[int], predicted, draft_s: float,
                 verify_s: float) -> StepReport:
    """A round's report from its :class:`~specdraft.verifier.Outcome` (``drafted``,
    ``num_accepted``, ``depths``), the tokens each row committed (``[batch]``) and the rows that
    drafted from their prediction (``predicted``); stamps each row's ``first_token`` /
    ``last_token`` with the report's time."""
    now = time.perf_counter()
    rows = []
    for b, s in enumerate(batch):
        gap = None if s.last_token is None else now - s.last_token
        if committed[b]:
            if s.first_token is None:
                s.first_token = now
            s.last_token = now
        rows.append(RowReport(s, committed=committed[b], drafted=outcome.drafted[b],
                              accepted=outcome.num_accepted[b], depth=outcome.depths[b], predicted=b in predicted,
                              gap=gap))
    return StepReport("round", rows, time=now, draft_s=draft_s, verify_s=verify_s)


def prefill_report(seq: Sequence, tokens: int, seconds: float) -> StepReport:
    """A prefill pass of ``tokens`` of ``seq``'s prompt that took ``seconds``."""
    return StepReport("prefill", [RowReport(seq, prefilled=tokens)], prefill_s=seconds)


def finish_report(seq: Sequence, reason: str) -> StepReport:
    """``seq`` leaves the engine (``reason``: its finish reason)."""
    return StepReport("finish", [RowReport(seq)], reason=reason)


def notify(observers: list[Observer], report: StepReport, failed: set) -> None:
    """Call every observer with ``report``; one that raises is logged (the first time) and skipped.
    ``failed``: the ids of observers already logged."""
    for observer in tuple(observers):  # a copy: an observer may remove itself
        try:
            observer(report)
        except Exception:  # noqa: BLE001 - an observer's failure never stops the engine
            if id(observer) not in failed:
                failed.add(id(observer))
                logger.exception("an engine observer (%r) failed; its later failures are not logged", observer)


def kv_cache_usage(engine) -> float:
    """The fraction (0..1) of the target cache's memory that running sequences have reserved
    (``kv_cache_memory``: at 1.0 newcomers wait, see :mod:`.memory`); for a cache without that
    bound (transformers' fallback), of its allocated positions that their tokens hold."""
    running = list(engine.scheduler.running)
    if engine.memory is not None:
        return engine.memory.usage(running)
    cache = engine.runner.cache  # HFCache: ``slots`` positions per row
    positions = len(getattr(cache, "stored", ())) * int(getattr(cache, "slots", 0) or 0)
    if positions <= 0:
        return 0.0
    used = sum(s.cached for s in running)
    return min(1.0, used / positions)


__all__ = ["Observer", "RowReport", "StepReport", "finish_report", "kv_cache_usage", "notify", "prefill_report",
           "round_report"]
