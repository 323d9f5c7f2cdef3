"""The server's one output loop: every request's stream read on the event loop, no thread per stream.

The engine decodes on its own thread and puts each sequence's bursts in its outbox
(:class:`~specdraft.engine.sequence.Outbox`). A stream the server reads is *watched*: the outbox's
callback marks it ready, and the first mark since the loop last looked schedules one wake-up of
the event loop (``call_soon_threadsafe``), which sets the ready requests' events; each request's
task then takes its bursts without waiting (``Stream.poll``). So a step of a batch of 256 streams
costs the event loop one wake-up, and a waiting or running request holds no thread (vLLM's
output handler feeding per-request queues plays the same part).
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator


class OutputLoop:
    """Reads streams on the running event loop (:meth:`watch`); one per app."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: set[asyncio.Event] = set()  # marked since the loop last looked
        self._scheduled = False

    def watch(self, stream) -> AsyncIterator:
        """``stream``'s bursts as they arrive (it must offer ``poll()`` and ``on_ready(callback)``);
        the request's error is raised as iterating the stream raises it."""
        loop, ready = asyncio.get_running_loop(), asyncio.Event()

        def mark() -> None:  # any thread: the engine's, or whichever closes the stream
            with self._lock:
                self._ready.add(ready)
                if self._scheduled:
                    return
                self._scheduled = True
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop is closed: the server is gone, and its readers with it
                pass

        stream.on_ready(mark)
        return self._read(stream, ready)

    def _wake(self) -> None:
        with self._lock:
            ready, self._ready, self._scheduled = self._ready, set(), False
        for event in ready:
            event.set()

    @staticmethod
    async def _read(stream, ready: asyncio.Event) -> AsyncIterator:
        while True:
            ready.clear()  # before polling: a mark from now on wakes the wait below
            try:
                chunk = stream.poll()
            except StopIteration:
                return
            if chunk is None:
                await ready.wait()
            else:
                yield chunk


__all__ = ["OutputLoop"]
