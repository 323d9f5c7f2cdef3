"""The target's KV cache sized by use, under a memory bound (``kv_cache_memory``).

The cache is a row per running sequence (:class:`~specdraft.cache.StaticCache`), every row as
long as the longest one needs. Each sequence reserves what its longest pass can write: its
prompt, its ``max_tokens`` and the widest verify pass after them (:meth:`KVMemory.need`). A
waiting sequence joins only when the rows then in use, each as long as the largest reservation
among them, fit the bound (:meth:`KVMemory.admission`); otherwise it waits for running ones to leave,
and one that could not fit even alone is refused when it is added (:meth:`KVMemory.check`). So
a running sequence never needs memory that is not there: nothing is preempted or recomputed,
and no output depends on what else was running.

What is allocated follows use below that bound: rows only up to the highest slot running, and
a row's length grows by doubling with the longest running sequence's tokens, never past the
largest reservation (:meth:`~specdraft.cache.StaticCache.fit`), and is given back when the
cache holds over four times what is in use. This is not paging: a short sequence beside a long
one holds a row as long as the long one's (docs/algorithm.md#kv-cache-memory).
"""

from __future__ import annotations

from ..errors import ConfigError
from .sequence import Sequence

#: the target cache's memory bound when none is given (vLLM's CPU default, VLLM_CPU_KVCACHE_SPACE)
DEFAULT_KV_MEMORY = 4 << 30


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class KVMemory:
    """The engine's bound on its target cache's rows: ``budget`` bytes for ``cache`` (a cache
    with ``fit`` and ``bytes_for``), passes at most ``widest`` tokens wide."""

    def __init__(self, cache, budget: int, widest: int) -> None:
        self.cache = cache
        self.budget = budget
        self.widest = widest

    def need(self, s: Sequence) -> int:
        """Positions ``s`` may write: its prompt and output, and a verify pass padded after them."""
        return s.max_len + self.widest + 1

    def check(self, sequences: list[Sequence]) -> None:
        """ConfigError (one line, nothing queued) when one of ``sequences`` could not fit even alone."""
        for s in sequences:
            alone = self.cache.bytes_for(1, self.need(s))
            if alone > self.budget:
                raise ConfigError(
                    f"this request needs {_mib(alone)} of KV cache (a prompt of {s.prompt_len} tokens and up to "
                    f"{s.max_len - s.prompt_len} more), more than the whole kv_cache_memory "
                    f"(--kv-cache-memory) of {_mib(self.budget)}: ask for fewer max_tokens, send a shorter "
                    "prompt, or give the cache more memory", param="max_new_tokens")

    def reserved(self, held: list[tuple[int, Sequence]]) -> int:
        """Bytes the rows of ``held`` (slot, sequence) pairs reserve: every row up to the highest
        slot, as long as the largest reservation among them."""
        return self.cache.bytes_for(max(slot for slot, _ in held) + 1, max(self.need(s) for _, s in held))

    def admission(self, running: list[Sequence]):
        """A check for newcomers joining ``running`` (the sequences holding rows) one at a time:
        ``check(seq, slot)`` says whether ``seq`` may join in row ``slot`` beside ``running`` and
        those it said yes to before (the reservations then within the budget), and counts it in
        if so. Constant time a newcomer: every row up to the highest slot, as long as the
        largest reservation (:meth:`reserved`), is two running maxima."""
        top = max((s.slot for s in running), default=-1)
        longest = max((self.need(s) for s in running), default=0)

        def check(seq: Sequence, slot: int) -> bool:
            nonlocal top, longest
            rows, positions = max(top, slot) + 1, max(longest, self.need(seq))
            if self.cache.bytes_for(rows, positions) > self.budget:
                return False
            top, longest = rows - 1, positions
            return True

        return check

    def fit(self, running: list[Sequence]) -> None:
        """Room in ``running``'s rows for their next pass: a prompt still prefilling whole, else the
        widest verify pass after the longest row (none running: memory back, one short row kept)."""
        rows = max((s.slot for s in running), default=0) + 1
        positions = max(((s.prompt_len if s.prefilling else s.cached) + self.widest + 1 for s in running), default=0)
        most = max((self.need(s) for s in running), default=positions)
        self.cache.fit(rows, positions, most)

    def usage(self, running: list[Sequence]) -> float:
        """The fraction of the budget the running sequences have reserved (1.0: newcomers wait).
        Any thread (a metrics scrape): a sequence leaving meanwhile has no slot, and is skipped."""
        held = [(slot, s) for s in running if (slot := s.slot) is not None]
        return min(1.0, self.reserved(held) / self.budget) if held else 0.0


def check_kv_memory(value) -> int:
    """``kv_cache_memory`` as bytes (an int, or a size such as ``"8GiB"``), more than zero."""
    from .prefix import parse_memory

    memory = parse_memory(value, what="kv_cache_memory")
    if memory <= 0:
        raise ConfigError(f"kv_cache_memory must be more than 0 bytes (the running requests' KV cache), got {value!r}",
                          param="kv_cache_memory")
    return memory


__all__ = ["DEFAULT_KV_MEMORY", "KVMemory", "check_kv_memory"]
