"""The target sharded over 2 ranks (gloo, processes on 127.0.0.1), as users run it: the checks of
:mod:`specdraft.testing.tensor_parallel` in a fresh process (tiny models of every architecture and
the default model), ``specdraft generate --tensor-parallel 2``, ``specdraft serve --tensor-parallel 2``
over HTTP, and a rank killed mid-generation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from specdraft.testing import SIGNIFICANCE
from specdraft.testing.commands import specdraft_command, start_serve, stop_with_ctrl_c


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "results.json"
    # passes' collectives time out after 10 s here, so the idle check idles past it in 12 s (the
    # other ranks wait for rank 0's next message without a limit, as an idle server's must)
    run = subprocess.run([sys.executable, "-m", "specdraft.testing.tensor_parallel", str(out), "--default-model"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "SPECDRAFT_TP_TIMEOUT": "10"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_sharded_logits_equal_unsharded_ones_in_float64(checks):
    """Every tiny architecture that has a KV head per rank, and the default model (3 KV heads: 2 + 1)."""
    assert set(checks["logits"]) == {"llama", "llama3-tied", "mistral-window", "qwen2-tied"}
    for kind, diff in checks["logits"].items():
        assert diff < 1e-9, kind
    assert checks["default"]["logits"] < 1e-9
    assert "more ranks than this model's 1 KV heads" in checks["refused"]  # qwen3's tiny model


def test_greedy_speculation_on_a_sharded_target_equals_its_plain_decoding(checks):
    greedy = dict(checks["greedy"])
    assert greedy.pop("plain equals unsharded transformers")
    cache = greedy.pop("prefix cache")  # the same prompts again: read from each rank's prefix cache
    assert cache["equal"] and cache["cached"] == cache["prompt"]
    assert set(greedy) == {"prompt-lookup", "draft-model", "eagle", "eagle-tree"}
    for label, result in greedy.items():
        assert result["equal"], label
        assert result["drafted"] > 0, label
    assert greedy["prompt-lookup"]["accepted"] > 0  # drafts were verified and kept, not just proposed


def test_greedy_speculation_on_the_sharded_default_model_in_bfloat16_equals_its_plain_decoding(checks):
    assert checks["default"]["bf16 greedy equal"]
    assert checks["default"]["bf16 accepted"] > 0


def test_sampled_speculation_on_a_sharded_target_follows_its_distribution(checks):
    """bfloat16, against the sharded target's distribution enumerated from its own logits (the
    all-reduce rounds differently from an unsharded target). float64 is not run: its sharded
    logits equal the unsharded ones (above), and sampling's arithmetic is float32 in every dtype."""
    sampled = checks["sampled bf16"]
    assert sampled["pvalue"] > SIGNIFICANCE
    assert sampled["accepted"] > sampled["samples"] // 10


def test_the_ranks_wait_for_rank_0_past_the_pass_timeout_and_a_closed_runner_refuses_passes(checks):
    """An idle server sends the other ranks nothing for as long as it is idle: with the passes'
    timeout at 10 s, 12 s of idling used to end rank 1 ("Timed out waiting ... for recv")."""
    idle = checks["idle and close"]
    assert idle["idled"] == 12 and idle["same after idling"]
    assert "runner was closed" in idle["closed"] and "make a new decoder" in idle["closed"]


def test_generate_tensor_parallel_2_prints_plain_decodings_text(days):
    out = subprocess.run([*specdraft_command(), "generate", "--tensor-parallel", "2", "--drafter", "prompt-lookup",
                          "--dtype", "float64", "--max-new-tokens", str(days.new), days.prompt],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == days.plain.text + "\n" and "Monday" in out.stdout


def test_serve_tensor_parallel_2_answers_as_plain_decoding_and_ctrl_c_ends_every_rank(tmp_path, days):
    """``specdraft serve --tensor-parallel 2`` through the openai client over HTTP: a greedy chat
    completion equals plain decoding, and Ctrl-C ends the server and its rank."""
    served = start_serve(tmp_path, "--drafter", "prompt-lookup", "--tensor-parallel", "2", "--dtype", "float64")
    try:
        ranks = _ranks(served.proc.pid)
        assert len(ranks) == 1
        name = httpx.get(f"{served.base}/v1/models", timeout=30).json()["data"][0]["id"]
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": days.prompt}],
                                           max_tokens=days.new, temperature=0)
    finally:
        code = stop_with_ctrl_c(served.proc)
    assert r.choices[0].message.content == days.plain.text and r.usage.completion_tokens == len(days.plain.token_ids)
    assert code == 130
    assert "Traceback" not in served.stderr.read_text()
    assert not [rank for rank in ranks if _running(rank)]


def _ranks(pid: int) -> list[int]:
    """Processes started by ``pid`` (its tensor-parallel ranks)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in children.read_text().split()] if children.exists() else []


def test_a_rank_killed_mid_generation_ends_the_command_with_one_line():
    proc = subprocess.Popen([*specdraft_command(), "generate", "--tensor-parallel", "2", "--drafter", "prompt-lookup",
                             "--ignore-eos", "--stream", "--max-new-tokens", "4000",
                             "Write a long story about a lighthouse."], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        first = proc.stdout.read(1)  # text is being generated: every rank is in the loop
        assert first, proc.stderr.read()
        ranks = _ranks(proc.pid)
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1
    assert err.strip().splitlines() == ["specdraft: error: tensor-parallel rank 1 exited (status -9); "
                                        "ending the other ranks"]
    assert not [r for r in ranks if _running(r)]  # rank 0 saw the exit (and reaped it) before it ended


#: a program whose rank 0 fails partway through a pass, after the other rank got the message
FAILING_PASS = """
import os

from specdraft import SpeculativeDecoder
from specdraft.testing import tiny_llama

def broken(*args, **kwargs):
    raise RuntimeError("boom")

if __name__ == "__main__":
    dec = SpeculativeDecoder(tiny_llama(), None, drafter="none", tensor_parallel=2)
    print(open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read(), flush=True)  # the other rank
    dec.runner.local.forward = broken
    dec.generate_ids([[1, 2, 3]], max_new_tokens=4)
"""


def test_rank_0_failing_partway_through_a_pass_ends_the_ranks_with_one_line():
    """The other rank is inside the pass by then, so rank 0 cannot go on (its next message would
    meet that rank's all-reduce): one line, exit 1, no rank left."""
    out = subprocess.run([sys.executable, "-c", FAILING_PASS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == ["specdraft: error: tensor-parallel rank 0 failed partway through "
                                               "forward (boom), so the ranks are out of step; ending the other ranks"]
    ranks = [int(pid) for pid in out.stdout.split()]
    assert len(ranks) == 1 and not _running(ranks[0])


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
