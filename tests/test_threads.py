"""One decoder used from several threads: each caller gets exactly its own output."""

from __future__ import annotations

import threading

from specdraft import SpeculativeDecoder
from specdraft.testing import repetitive_prompts


def test_eight_threads_each_get_their_own_output(tiny_model):
    dec = SpeculativeDecoder(tiny_model, None, drafter="ngram", spec_length=3)
    jobs = [[p[: 3 + t] + [t, t + 1] for p in repetitive_prompts(64, seed=t)[:3]] for t in range(8)]  # 8 x 3 prompts
    settings = [dict(temperature=0.0) if t % 2 else dict(temperature=0.9, seed=t) for t in range(8)]
    sequential = [[r.token_ids for r in dec.generate_ids(job, max_new_tokens=20, **s)] for job, s in zip(jobs, settings)]

    got: list = [None] * 8
    errors: list = []
    start = threading.Barrier(8)

    def work(t):
        try:
            start.wait()
            got[t] = [r.token_ids for r in dec.generate_ids(jobs[t], max_new_tokens=20, **settings[t])]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert got == sequential
