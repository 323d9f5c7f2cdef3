"""The compiled runner: same logits as eager, padding never leaks, no recompiles after warm-up,
and speculative decoding through it stays token-identical to plain decoding."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from specdraft import SpeculativeDecoder
from specdraft.runner import WIDTH_BUCKETS, load_runner, width_bucket
from specdraft.testing import plain_greedy, repetitive_prompts, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64, seed=3)


def test_width_buckets():
    assert [width_bucket(w) for w in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    assert width_bucket(WIDTH_BUCKETS[-1] + 1) is None


@torch.inference_mode()
def test_compiled_equals_eager_and_padding_is_cut(model):
    eager, compiled = load_runner(model), load_runner(model, compile=True)
    assert compiled.info == {"implementation": "specdraft", "compiled": True, "quantization": None,
                             "dtype": str(model.dtype).removeprefix("torch."), "kernels": {"packed": 0}}
    tokens = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(1))
    for runner in (eager, compiled):
        runner.cache.reset(2, 64)
        runner.forward(tokens[:, :20], advance=[20, 17])  # ragged rows
    for width in (1, 3, 5):
        chunk = tokens[:, 20:20 + width]
        (a, ha), (b, hb) = (r.forward(chunk, hidden=True) for r in (eager, compiled))
        assert b.shape == a.shape == (2, width, 64) and hb.shape == ha.shape  # padded to 1, 4, 8: cut back
        # float64 model, but RMSNorm normalizes in float32 (as transformers does), where the
        # compiled reduction may sum in another order: agreement to float32 rounding
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(hb, ha, rtol=1e-5, atol=1e-6)
        assert torch.equal(eager.cache.lengths, compiled.cache.lengths)
        for r in (eager, compiled):
            r.cache.set_lengths([20, 17])  # roll back; the padding written past the lengths is never read
    # caches agree on every stored position after the rollbacks
    for mine, ref in zip(compiled.cache.kv.keys, eager.cache.kv.keys):
        for b, n in enumerate((20, 17)):
            torch.testing.assert_close(mine[b, :, :n], ref[b, :, :n], rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_no_recompiles_after_warm_up(model):
    runner = load_runner(model, compile=True)
    runner.warm_up(1, range(1, 7))
    graphs = counters["stats"]["unique_graphs"]
    recompiles = sum(counters["recompiles"].values())
    runner.cache.reset(1, 800)
    gen = torch.Generator().manual_seed(0)
    length = 0
    for _ in range(100):  # rounds: a verify pass of 1..6 tokens, then a rollback to what was kept
        width = int(torch.randint(1, 7, (1,), generator=gen))
        runner.forward(torch.randint(0, 64, (1, width), generator=gen))
        length += int(torch.randint(1, width + 1, (1,), generator=gen))
        runner.cache.set_lengths([length])
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["recompiles"].values()) == recompiles


@pytest.mark.parametrize("drafter", ["ngram", "prompt-lookup"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_compiled_speculative_equals_plain(model, drafter, k):
    prompts = repetitive_prompts(64, seed=0)[:3]  # ragged
    expected = [plain_greedy(model, p, 24) for p in prompts]
    dec = SpeculativeDecoder(model, None, drafter=drafter, spec_length=k, compile=True)
    assert dec.runner_info["compiled"]
    assert [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=24)] == expected
    assert dec.generate_ids(prompts[:1], max_new_tokens=24)[0].token_ids == expected[0]


@pytest.mark.parametrize("settings", [{}, {"compile": True}, {"quantize": "int8"}, {"quantize": "int4", "compile": True}],
                         ids=["eager", "compiled", "int8", "int4-compiled"])
@torch.inference_mode()
def test_same_inputs_give_bit_identical_logits_run_after_run(settings):
    """No kernel is chosen by timing: two fresh runners (and two passes) agree bit for bit."""
    model = tiny_llama(vocab_size=64, seed=9).float()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    outs = []
    for _ in range(2):
        runner = load_runner(model, **settings)
        runner.cache.reset(2, 32)
        runner.forward(tokens[:, :8])
        outs.append(runner.forward(tokens[:, 8:], hidden=True))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])



@torch.inference_mode()
def test_a_gathered_pass_does_not_recompile_as_the_caches_rows_change(model):
    """The engine's cache has rows up to the highest slot running (``engine.memory``), so a pass
    over slots that are not a run (gathered: keys and values of every row) meets caches of 3, 4, 5
    rows: the graph compiled for the first serves them all, with the eager runner's logits."""
    compiled, eager = load_runner(model, compile=True), load_runner(model)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 3), generator=gen)
    for i, rows in enumerate((3, 4, 5)):
        for r in (compiled, eager):
            r.cache.reset(rows, 64)
            r.forward(torch.randint(0, 64, (rows, 5), generator=torch.Generator().manual_seed(rows)))
        if i == 1:  # the second row count: no new graph from here on
            graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
        a, _ = eager.forward(tokens, slots=[0, 2])
        b, _ = compiled.forward(tokens, slots=[0, 2])
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["recompiles"].values()) == recompiles
