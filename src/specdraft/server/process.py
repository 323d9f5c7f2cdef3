"""The ``specdraft serve`` process around the app: uvicorn's settings, a read timeout, and the drain.

* :class:`ReadTimeoutProtocol`: uvicorn's h11 protocol with a deadline for each request's
  headers and body (uvicorn has none: a client sending a byte now and then would keep its
  connection forever); a late one gets 408 and the connection is closed.
* :class:`DrainingApp` and :class:`SpecdraftServer`: on SIGTERM (or Ctrl-C) the server drains:
  new requests get 503 (``code: "server_shutting_down"``), waiting ones end at once with that
  error, running ones get ``drain_timeout`` seconds to finish and are then ended with it too (a
  stream: one error event, then ``data: [DONE]``; otherwise a 503); then uvicorn closes the
  connections and the process exits (0 after SIGTERM, 130 after Ctrl-C). A second signal ends
  the drain at once, a third stops without waiting for the connections.

Imported only when ``serve`` runs (it imports uvicorn).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


logger = logging.getLogger("specdraft.server")

#: the message and code of every request a shutdown ends or turns away
SHUTTING_DOWN = "the server is shutting down; retry the request (on another server, or once this one is back)"
SHUTTING_DOWN_CODE = "server_shutting_down"


def shutdown_error():
    """The 503 a request ended (or refused) by the shutdown is answered with (a stream: its error event)."""
    from .errors import APIError

    return APIError(503, SHUTTING_DOWN, type="server_error", code=SHUTTING_DOWN_CODE)


def end_requests(decoder, running: bool) -> int:
    """End the decoder's waiting requests, and its running ones when ``running``, with
    :func:`shutdown_error` (the app answers a 503, or sends it as a stream's error event before
    ``[DONE]``); how many were ended."""
    return decoder.end_requests(shutdown_error(), running=running)


class DrainState:
    """Whether the server is draining (shared by :class:`DrainingApp` and :class:`SpecdraftServer`)."""

    def __init__(self) -> None:
        self.draining = False


class DrainingApp:
    """The app, except that while the server drains every HTTP request but ``/metrics`` gets
    the shutdown's 503 (``Connection: close``), ``/health`` included, so load balancers stop
    sending traffic here."""

    def __init__(self, app, state: DrainState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.state.draining and scope["path"] != "/metrics":
            error = shutdown_error()
            metrics = getattr(getattr(self.app, "state", None), "metrics", None)
            if metrics is not None:
                metrics.error(error.status)
            response = error.response()
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class ReadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, with ``read_timeout`` seconds for a request's headers and body to
    arrive, counted from the connection (or the previous answer on it) on. An idle connection is
    closed quietly (as uvicorn's keep-alive timeout does); one with part of a request gets a 408
    JSON error and is closed. Once the whole request has arrived, the answer takes as long as it
    takes. Use :func:`read_timeout_protocol` for a class with a timeout."""

    read_timeout: float = 0.0  # 0: no limit
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read_timer()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event) -> None:
        self._stop_read_timer()  # the connection is a websocket's from now on
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._start_read_timer()  # the next request's headers and body

    def _start_read_timer(self) -> None:
        self._stop_read_timer()
        if self.read_timeout > 0:
            self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        between = cycle is None or cycle.response_complete  # waiting for a request's headers
        if not between and (not cycle.more_body or cycle.response_started):
            return  # the whole request is here (or answered): the app has it
        if between and self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self.transport.close()  # nothing of a request: idle
            return
        logger.warning("closed a connection from %s: its request did not arrive within %g s (--read-timeout)",
                       "%s:%d" % self.client if self.client else "a client", self.read_timeout)
        body = json.dumps({"error": {
            "message": f"the request's headers and body did not arrive within {self.read_timeout:g} s; "
                       "send the whole request at once", "type": "invalid_request_error", "param": None,
            "code": "request_timeout"}}).encode()
        head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n" % len(body))
        self.transport.write(head + body)  # h11 cannot send a response before a request: written as it is
        self.transport.close()


def read_timeout_protocol(seconds: float) -> type[ReadTimeoutProtocol]:
    """:class:`ReadTimeoutProtocol` with ``read_timeout = seconds`` (0: no limit)."""
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,), {"read_timeout": float(seconds)})


class SpecdraftServer(uvicorn.Server):
    """uvicorn's server, with the ready line and the drain (see the module's docstring).

    ``decoder``: the app's :class:`~specdraft.SpeculativeDecoder`, whose requests the drain
    ends; ``state``: the :class:`DrainState` its :class:`DrainingApp` reads."""

    def __init__(self, config: uvicorn.Config, decoder, state: DrainState, drain_timeout: float,
                 ready: str | None = None) -> None:
        super().__init__(config)
        self.decoder, self.state, self.drain_timeout, self.ready = decoder, state, drain_timeout, ready
        self._drain_deadline: float | None = None
        self._drain_reported = False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit and self.ready:
            print(self.ready, flush=True)

    def handle_exit(self, sig: int, frame) -> None:
        """A signal: the first starts the drain, a second ends it at once, a third stops without
        waiting for the connections. Only Ctrl-C is raised again once the server has stopped
        (KeyboardInterrupt: exit status 130); a SIGTERM that drained ends the process with 0."""
        if sig == signal.SIGINT:
            self._captured_signals.append(sig)
        if not self.state.draining:
            self.state.draining = True  # set here, not at the next tick: new requests get 503 from now on
            self._drain_deadline = time.monotonic() + self.drain_timeout
        elif not self.should_exit:
            self._drain_deadline = 0.0
        else:
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.state.draining and not self.should_exit:
            await self._drain()
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        """One tick of the drain: waiting requests end now, running ones once the time is up;
        the server stops when none is left."""
        decoder = self.decoder
        final = time.monotonic() >= self._drain_deadline
        waiting, running = decoder.num_waiting, decoder.num_running
        ended = await asyncio.to_thread(end_requests, decoder, final)
        if not self._drain_reported:
            self._drain_reported = True
            logger.info("shutting down: new requests get 503, %d waiting requests were ended (503), %d running "
                        "ones %s", waiting, running, "were ended (503)" if final else
                        f"get up to {self.drain_timeout:g} s to finish (signal again to end them now)")
        elif final and ended:
            logger.info("shutting down: %d running requests were ended (503)", ended)
        if final or decoder.num_running + decoder.num_waiting == 0:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown, while requests that still reach the engine (their body was being
        read when the drain ended) are ended as they come."""

        async def keep_ending() -> None:
            while True:
                await asyncio.to_thread(end_requests, self.decoder, True)
                await asyncio.sleep(0.1)

        ending = asyncio.create_task(keep_ending())
        try:
            await super().shutdown(sockets=sockets)
        finally:
            ending.cancel()


def make_server(app, decoder, *, drain_timeout: float, read_timeout: float, timeout_keep_alive: float,
                limit_concurrency: int, max_header_bytes: int, graceful_shutdown: float, backlog: int,
                ready: str | None = None, log_config=None, log_level: str = "info") -> SpecdraftServer:
    """``specdraft serve``'s server for ``app`` (serving ``decoder``): the drain, the read timeout,
    and uvicorn's own limits (``--timeout-keep-alive``, ``--limit-concurrency``, ``--max-header-bytes``
    as h11's largest incomplete event). Run it with ``.run(sockets=[sock])``."""
    state = DrainState()
    config = uvicorn.Config(
        DrainingApp(app, state), http=read_timeout_protocol(read_timeout), timeout_keep_alive=timeout_keep_alive,
        limit_concurrency=limit_concurrency, h11_max_incomplete_event_size=max_header_bytes, backlog=backlog,
        timeout_graceful_shutdown=graceful_shutdown, log_level=log_level, log_config=log_config)
    return SpecdraftServer(config, decoder, state, drain_timeout=drain_timeout, ready=ready)


__all__ = ["DrainState", "DrainingApp", "ReadTimeoutProtocol", "SHUTTING_DOWN", "SHUTTING_DOWN_CODE",
           "SpecdraftServer", "end_requests", "make_server", "read_timeout_protocol", "shutdown_error"]
