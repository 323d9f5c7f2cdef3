"""The server's fixtures: uvicorn in a background thread of the test process, and a fake decoder.

``serve(app)`` (the ``serve`` fixture) runs an app on a socket bound to a free port of 127.0.0.1
and yields its base URL; the server stops when the ``with`` block ends. ``FakeDecoder`` follows
the engine's streaming API (``stream_ids`` -> a ``Stream`` of bursts, ``close``, ``QueueFull``,
``num_running`` / ``num_waiting``) without a model, so the HTTP layer's tests take milliseconds;
the real model's tests are in ``test_server_e2e.py``.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the server's tests need pip install 'specdraft[serve]'")
pytest.importorskip("openai", reason="the server's tests talk to it with the openai client")

import uvicorn  # noqa: E402

from specdraft.errors import ConfigError, DrafterError, QueueFull  # noqa: E402
from specdraft.types import GenerationResult, GenerationStats  # noqa: E402


@contextlib.contextmanager
def serve(app, timeout: float = 30.0):
    """Run ``app`` with uvicorn in a background thread; yields ``http://127.0.0.1:PORT``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def wait_for(condition, timeout: float = 30.0, interval: float = 0.02) -> bool:
    """Poll ``condition()`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())


# -- a decoder without a model, following the engine's streaming API ------------------------


@dataclass
class StreamChunk:
    text: str
    token_ids: list[int]


@dataclass
class FakeTarget:
    name: str = "fake-model"
    max_context: int = 64


@dataclass
class FakeDrafter:
    name: str = "fake-drafter"


class FakeStream:
    """Token ``i`` of the output is ``100 + (prompt length + i) % 50``, written `` t<id>``; bursts of
    up to 3 tokens every ``decoder.delay`` seconds, once the request has a place in the batch (and,
    when ``decoder.bursts`` is a semaphore, each burst has taken one of its permits)."""

    def __init__(self, decoder: "FakeDecoder", prompt_ids: list[int], max_new_tokens: int, stop,
                 prediction=None) -> None:
        self.decoder, self.max_new_tokens = decoder, max_new_tokens
        self.seq = SimpleNamespace(prediction=prediction, stats=GenerationStats())  # what the server reads of it
        self.stops = [stop] if isinstance(stop, str) else list(stop or ())
        self.prompt_tokens = len(prompt_ids)
        self.result: GenerationResult | None = None
        self.tokens: list[int] = []
        self.text = ""
        self.closed = threading.Event()
        self.admitted = threading.Event()

    def __iter__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _finish(self, reason: str) -> None:
        if self.result is None:
            stats = GenerationStats(prompt_tokens=self.prompt_tokens, new_tokens=len(self.tokens),
                                    drafts=len(self.tokens) // 3, drafted_tokens=len(self.tokens),
                                    accepted_tokens=2 * (len(self.tokens) // 3),
                                    target_passes=-(-len(self.tokens) // 3),
                                    drafted_per_position=[3, 2], accepted_per_position=[2, 1])
            self.result = GenerationResult(list(self.tokens), self.text, reason, stats)
            self.decoder._leave(self)

    def __next__(self) -> StreamChunk:
        while not self.admitted.wait(0.01):
            if self.closed.is_set():
                break
        if self.closed.is_set() or self.result is not None:
            self._finish("aborted")
            raise StopIteration
        if self.closed.wait(self.decoder.delay) or not self._permit():
            self._finish("aborted")
            raise StopIteration
        if self.decoder.fail:
            self.decoder.fail = False
            self._finish("aborted")
            raise DrafterError("drafter 'fake-drafter' failed while drafting: RuntimeError: boom")
        burst = []
        while len(burst) < 3 and len(self.tokens) < self.max_new_tokens:
            token = 100 + (self.prompt_tokens + len(self.tokens)) % 50
            self.tokens.append(token)
            burst.append(token)
        text = "".join(f" t{t}" for t in burst)
        self.text += text
        for s in self.stops:
            if s in self.text:
                cut = self.text.index(s)
                text = text[: max(0, len(text) - (len(self.text) - cut))]
                self.text = self.text[:cut]
                self._finish("stop")
                return StreamChunk(text, burst)
        if len(self.tokens) >= self.max_new_tokens:
            self._finish("length")
        return StreamChunk(text, burst)

    def _permit(self) -> bool:
        """Take a permit for the next burst from ``decoder.bursts`` (False: closed while waiting)."""
        gate = self.decoder.bursts
        while gate is not None and not gate.acquire(timeout=0.01):
            if self.closed.is_set():
                return False
        return True

    def close(self) -> None:
        self.closed.set()
        self.decoder.closed += 1
        self._finish("aborted")

    # the engine stream's non-blocking side (the server's output loop): a producer thread of the
    # fake's own plays the engine, running the blocking iteration above and marking each burst ready

    def on_ready(self, callback) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._produce, args=(callback,), daemon=True, name="fake-engine").start()

    def _produce(self, callback) -> None:
        while True:
            try:
                item = ("burst", next(self))
            except StopIteration:
                item = ("end", None)
            except Exception as exc:  # noqa: BLE001 - handed to the reader, as the engine does
                item = ("error", exc)
            self._outbox.put(item)
            callback()
            if item[0] != "burst":
                return

    def poll(self):
        try:
            kind, value = self._outbox.get_nowait()
        except queue.Empty:
            return None
        if kind == "end":
            self._outbox.put((kind, value))  # the end stays the end
            raise StopIteration
        if kind == "error":
            raise value
        return value


class FakeDecoder:
    """Bytes of the prompt as token ids; the chat template is ``role: content`` lines.

    Tests that need a request to stay running (or waiting) set ``bursts`` to a
    ``threading.Semaphore`` of the bursts allowed so far (0: none), instead of relying on a delay
    being long enough; ``arrived`` is set when ``stream_ids`` has taken a request.
    """

    tokenizer = None  # token ids only

    def __init__(self, max_batch: int = 4, max_waiting: int | None = 4, delay: float = 0.005) -> None:
        self.target, self.drafter = FakeTarget(), FakeDrafter()
        self.max_batch, self.max_waiting, self.delay = max_batch, max_waiting, delay
        self.running: list[FakeStream] = []
        self.waiting: list[FakeStream] = []
        self.fail = False  # the next burst raises DrafterError
        self.closed = 0  # close() calls
        self.calls: list[dict] = []  # stream_ids' arguments
        self.bursts: threading.Semaphore | None = None  # None: bursts flow freely
        self.arrived = threading.Event()  # a request was taken (running or waiting)
        self._lock = threading.Lock()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        assert raw, "completions tokenize the prompt raw"
        return list(prompt.encode())

    def encode_chat(self, messages: list[dict], chat_template_kwargs=None, *, add_special_tokens=False,
                    check_text=None) -> list[int]:
        """``role: content`` lines; ``chat_template_kwargs`` are recorded in ``template_kwargs``."""
        self.template_kwargs = dict(chat_template_kwargs or {})
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if check_text is not None:
            check_text(text)
        return list(text.encode())

    def stream_ids(self, prompt_ids, settings) -> FakeStream:
        self.calls.append(dict(prompt_ids=list(prompt_ids), **{name: getattr(settings, name) for name in (
            "max_new_tokens", "temperature", "top_k", "top_p", "seed", "min_p", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "prediction", "ignore_eos", "min_tokens")},
            stop=list(settings.stop) or None, stop_token_ids=list(settings.stop_token_ids) or None))
        max_new_tokens, stop, prediction = settings.max_new_tokens, settings.stop, settings.prediction
        if len(prompt_ids) >= self.target.max_context:
            raise ConfigError(f"prompt 0 has {len(prompt_ids)} tokens but the model's context holds "
                              f"{self.target.max_context}; shorten it to at most {self.target.max_context - 1} tokens",
                              param="prompt")
        stream = FakeStream(self, list(prompt_ids), max_new_tokens, stop, prediction)
        with self._lock:
            if len(self.running) < self.max_batch:
                self.running.append(stream)
                stream.admitted.set()
            elif self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests already wait for the engine; retry later")
            else:
                self.waiting.append(stream)
        self.arrived.set()
        return stream

    def _leave(self, stream: FakeStream) -> None:
        with self._lock:
            if stream in self.running:
                self.running.remove(stream)
            if stream in self.waiting:
                self.waiting.remove(stream)
            while self.waiting and len(self.running) < self.max_batch:
                admitted = self.waiting.pop(0)
                self.running.append(admitted)
                admitted.admitted.set()


@pytest.fixture(name="serve", scope="session")
def serve_fixture():
    """``with serve(app) as url``: the app on a free port of 127.0.0.1 (see :func:`serve`)."""
    return serve


@pytest.fixture(name="wait_for", scope="session")
def wait_for_fixture():
    return wait_for


@pytest.fixture
def make_fake_decoder():
    """``make_fake_decoder(max_batch=4, max_waiting=4, delay=0.005)``: a :class:`FakeDecoder`."""
    return FakeDecoder


@pytest.fixture
def fake_decoder():
    return FakeDecoder()
