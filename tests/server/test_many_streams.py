"""256 streams at once over real HTTP, read by the server's one output loop (specdraft.server.outputs):
every stream's text is its offline generation, and the server holds a handful of threads, not one
per stream. A tiny random Llama with the default model's tokenizer; greedy, so the offline answer
is the answer."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from specdraft.server import create_app

pytestmark = pytest.mark.server

STREAMS = 256


def server_threads() -> int:
    """Threads of this process but the test client's."""
    return sum(not t.name.startswith("client") for t in threading.enumerate())
#: threads the server may add while it serves them all: the engine's and the prompt encoders'
#: (app.BLOCKING_THREADS), with one to spare
EXTRA_THREADS = 6


@pytest.fixture(scope="module")
def decoder(smol_tokenizer):
    from specdraft import SpeculativeDecoder
    from specdraft.testing import tiny_llama

    model = tiny_llama(vocab_size=len(smol_tokenizer), seed=9, max_positions=128)
    with SpeculativeDecoder(model, smol_tokenizer, drafter="ngram", target_name="tiny", spec_length=3,
                            max_batch=32) as dec:
        yield dec


def test_256_concurrent_streams_each_get_their_offline_text_on_a_handful_of_threads(decoder, serve):
    from specdraft.server.app import BLOCKING_THREADS

    assert EXTRA_THREADS >= BLOCKING_THREADS + 1
    prompts = [f"Note {i}: the {['red', 'green', 'blue', 'odd'][i % 4]} box holds {i * 7 % 31} keys and" for i in
               range(STREAMS)]
    offline = [r.text for r in decoder.generate(prompts, raw=True, max_new_tokens=6)]

    async def run(base: str) -> tuple[list[str], int, int]:
        # the client's own threads (its loop resolves addresses in an executor) are not the server's
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1, thread_name_prefix="client"))
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        opened = 0
        baseline = server_threads()
        most = baseline

        async def one(prompt: str) -> str:
            nonlocal opened
            text = ""
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                                     stream=True)
            opened += 1
            async for chunk in stream:
                text += chunk.choices[0].text
            return text

        async def count_threads() -> None:
            nonlocal most
            while True:
                most = max(most, server_threads())
                await asyncio.sleep(0.005)

        counter = asyncio.create_task(count_threads())
        try:
            texts = await asyncio.gather(*(one(p) for p in prompts))
        finally:
            counter.cancel()
            await client.close()
        assert opened == STREAMS
        return list(texts), baseline, most

    with serve(create_app(decoder)) as base:
        texts, baseline, most = asyncio.run(run(base))
    assert texts == offline
    assert most - baseline <= EXTRA_THREADS, f"{most - baseline} threads more while serving {STREAMS} streams"
