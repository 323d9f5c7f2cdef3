"""``specdraft serve``'s process settings on the fake decoder, over real sockets: the read timeout
(408 for a request's headers or body that do not arrive in time, an idle connection closed),
answers that take longer than it left alone, uvicorn's connection cap (503) and limit on incomplete
headers (400). The drain on SIGTERM needs the real engine: ``test_server_e2e.py`` runs it."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from specdraft.server import create_app
from specdraft.server.process import make_server

pytestmark = pytest.mark.server

SETTINGS = dict(drain_timeout=10.0, read_timeout=30.0, timeout_keep_alive=5.0, limit_concurrency=512,
                max_header_bytes=16 * 1024, graceful_shutdown=2.0, backlog=128, log_config=None, log_level="error")


@contextlib.contextmanager
def running(decoder, **settings):
    """``make_server`` (serve's settings, changed by ``settings``) on a free port of 127.0.0.1 in a
    background thread; yields ``(server, (host, port))``."""
    server = make_server(create_app(decoder), decoder, **(SETTINGS | settings))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield server, sock.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def read_all(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    conn.settimeout(10)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_a_request_that_does_not_arrive_in_time_gets_408_and_is_closed(fake_decoder):
    with running(fake_decoder, read_timeout=0.3) as (_, address):
        with socket.create_connection(address) as conn:  # headers that trickle in: the deadline stays
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.15)
            conn.sendall(b"Content-Type: application/json\r\n")
            answer = read_all(conn)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head
        assert json.loads(body)["error"]["code"] == "request_timeout"
        with socket.create_connection(address) as conn:  # a body that does not come
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            assert read_all(conn).startswith(b"HTTP/1.1 408 ")
        with socket.create_connection(address) as conn:  # nothing at all: closed without a word
            assert read_all(conn) == b""
        assert fake_decoder.calls == []


def test_answers_that_take_longer_than_the_read_timeout_are_left_alone(make_fake_decoder):
    decoder = make_fake_decoder(delay=0.05)  # 30 tokens: 10 bursts, 0.5 s
    with running(decoder, read_timeout=0.3) as (_, (host, port)):
        with httpx.Client(base_url=f"http://{host}:{port}", timeout=30) as client:
            for _ in range(2):  # the second on the same connection, after the first answer
                events = []
                with client.stream("POST", "/v1/completions",
                                   json={"prompt": "Hi", "max_tokens": 30, "stream": True}) as r:
                    events = [line for line in r.iter_lines() if line.startswith("data: ")]
                assert r.status_code == 200 and events[-1] == "data: [DONE]"
                assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
                assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]).count(" t") == 30


def test_the_connection_cap_answers_503(fake_decoder, wait_for):
    """uvicorn's --limit-concurrency counts open connections (idle ones too) and requests."""
    with running(fake_decoder, limit_concurrency=2) as (server, (host, port)):
        assert httpx.get(f"http://{host}:{port}/health").status_code == 200
        with socket.create_connection((host, port)):  # an idle connection: with the next one, two
            assert wait_for(lambda: len(server.server_state.connections) == 1)
            assert httpx.get(f"http://{host}:{port}/health").status_code == 503


def test_headers_over_the_limit_are_400(fake_decoder):
    """--h11-max-incomplete-event-size: headers still incomplete past it are refused."""
    with running(fake_decoder, max_header_bytes=2048) as (_, address):
        for size, status in ((1000, b"200"), (4000, b"400")):
            with socket.create_connection(address) as conn:
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: " + b"a" * size)
                time.sleep(0.2)  # the first part is read (and buffered) alone
                conn.sendall(b"\r\n\r\n")
                assert read_all(conn).startswith(b"HTTP/1.1 " + status), size
