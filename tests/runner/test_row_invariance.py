"""The property exact speculative decoding rests on (see specdraft.runner.kernels): a row's logits
from a pass of W tokens are bit-identical to what W one-token steps give it, for widths 1..16 and
for rows passed alone, in a batch and in a subset of the cache's rows, in float32, bfloat16,
int8 and int4 on CPU, for every architecture the runner reproduces and for the default model.
A bfloat16 model whose wide passes round differently flips greedy argmaxes (it did: 9 of 13
Spec-Bench outputs differed from plain decoding), so these tests compare bits, not closeness."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from specdraft.runner import cpu_ops, load_runner
from specdraft.runner.kernels import (CHECKED_ROWS, PackedLinear, decode_attention, elementwise_attention, packable,
                                      grouped_attention, pack_linears, checked_row_counts)
from specdraft.testing import differing_widths
from specdraft.testing.architectures import KINDS, tiny_hf

WIDTHS = range(1, 17)
#: (dtype the model loads in, quantize)
SETTINGS = {"float32": (torch.float32, None), "bfloat16": (torch.bfloat16, None), "int8": (torch.bfloat16, "int8"),
            "int4": (torch.bfloat16, "int4")}


def _assert_row_invariant(runner, vocab, widths=WIDTHS):
    """Three rows with prompts of different lengths: passes of every width over all rows, and over
    rows 0 and 2 only (a gathered subset), give each row the bits of its one-token steps."""
    assert differing_widths(runner, vocab, widths) == ([], []), "(all rows, rows 0 and 2): widths that differ"


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", KINDS)
def test_tiny_models_are_row_invariant(kind, setting):
    dtype, quantize = SETTINGS[setting]
    runner = load_runner(tiny_hf(kind, dtype=dtype), quantize=quantize)
    assert runner.dtype == (torch.float32 if setting == "float32" else torch.bfloat16)
    if quantize is None:  # every float linear runs through the packed kernel (float32 on AVX-512: panels)
        assert runner.model.kernels["packed"] == 4 * 2 + 1
        panels = cpu_ops.panels_apply(torch.nn.Linear(2, 2).to(dtype))
        assert runner.model.kernels.get("panels", 0) == (4 * 2 + 1 if panels else 0)
    # the layers' glue and attention: the C++ operators (.cpu_ops), but for Qwen3's per-head norms
    assert runner.model.kernels["cpu_ops"] == ("yes" if kind != "qwen3" else
                                               "per-head q/k norms (Qwen3) keep torch's operators")
    _assert_row_invariant(runner, 96)


@pytest.mark.parametrize("setting", ["float32", "bfloat16"])
def test_oneDNN_products_keep_the_rows_invariant_when_asked_for(monkeypatch, setting):
    """``SPECDRAFT_CPU_PRODUCTS=onednn``: every float linear oneDNN serves here is its checked
    product instead of a panel (the default on AMX processors until 2026-12-02), and exact."""
    monkeypatch.setenv(cpu_ops.PRODUCTS_ENV, "onednn")
    dtype, _ = SETTINGS[setting]
    runner = load_runner(tiny_hf(KINDS[0], dtype=dtype))
    onednn = packable(torch.nn.Linear(2, 2).to(dtype))  # else the panels serve (a CPU without oneDNN's bfloat16)
    assert runner.model.kernels["packed"] == 4 * 2 + 1
    assert runner.model.kernels.get("panels", 0) == (0 if onednn or cpu_ops.vector_bits() == 0 else 4 * 2 + 1)
    _assert_row_invariant(runner, 96)


@pytest.mark.parametrize("drafter", ["ngram", "prompt-lookup"])
def test_greedy_speculation_on_oneDNN_products_equals_their_plain_decoding(monkeypatch, drafter):
    """bfloat16 on oneDNN's checked products (``SPECDRAFT_CPU_PRODUCTS=onednn``): speculative greedy
    output token for token that of plain decoding on the same products, ragged batch and one row."""
    from specdraft import SpeculativeDecoder
    from specdraft.testing import repetitive_prompts

    monkeypatch.setenv(cpu_ops.PRODUCTS_ENV, "onednn")
    model = tiny_hf(KINDS[0], dtype=torch.bfloat16)
    prompts = repetitive_prompts(96, seed=0)[:3]
    with SpeculativeDecoder(model, None, drafter="none") as plain:
        assert "panels" not in plain.runner_info["kernels"] or not packable(torch.nn.Linear(2, 2).bfloat16())
        expected = [r.token_ids for r in plain.generate_ids(prompts, max_new_tokens=24)]
    with SpeculativeDecoder(model, None, drafter=drafter, spec_length=4) as dec:
        results = dec.generate_ids(prompts, max_new_tokens=24)
        assert [r.token_ids for r in results] == expected
        assert sum(r.stats.accepted_tokens for r in results) > 0  # drafts were accepted, not just bonus tokens
        assert dec.generate_ids(prompts[:1], max_new_tokens=24)[0].token_ids == expected[0]


@pytest.mark.e2e
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_default_model_is_row_invariant(request, setting):
    dtype, quantize = SETTINGS[setting]
    model, _ = request.getfixturevalue("default_f32" if dtype == torch.float32 else "default_bf16")
    runner = load_runner(model, quantize=quantize)
    _assert_row_invariant(runner, model.config.vocab_size, widths=[1, 2, 3, 5, 8, 16])


#: a tree of 6 nodes: parents (-1: the root, after the committed tokens), stored parents first
PARENTS = [-1, 0, 0, 1, 2, 3]


@pytest.mark.parametrize("setting", ["float32", "bfloat16"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_tree_passes_give_each_node_its_paths_one_token_steps(setting, compile):
    """A tree verify pass stores nodes side by side but each sees only its ancestors: its logits
    are bit-identical to one-token steps along its path (the keys meet the attention's sums in
    the order, and at the places, those steps give them)."""
    dtype, _ = SETTINGS[setting]
    runner = load_runner(tiny_hf("llama3-tied", dtype=dtype), compile=compile)
    gen = torch.Generator().manual_seed(6)
    prompt, tokens = torch.randint(96, (1, 11), generator=gen), torch.randint(96, (1, len(PARENTS)), generator=gen)
    paths = []
    for node, parent in enumerate(PARENTS):
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    mask = torch.zeros(1, len(PARENTS), len(PARENTS), dtype=torch.bool)
    for node, path in enumerate(paths):
        mask[0, node, path] = True
    depths = torch.tensor([[len(p) - 1 for p in paths]])
    with torch.inference_mode():
        runner.cache.reset(1, 64)
        runner.forward(prompt)
        tree, _ = runner.forward(tokens, tree_mask=mask, depths=depths)
        for node, path in enumerate(paths):
            runner.cache.set_lengths([prompt.shape[1]])
            for t in path:
                step, _ = runner.forward(tokens[:, t:t + 1])
            assert torch.equal(tree[:, node], step[:, 0]), f"node {node}"


def test_compiled_passes_are_row_invariant():
    """A compiled runner pads each pass to its width bucket: the padded rows change nothing either."""
    runner = load_runner(tiny_hf("llama", dtype=torch.bfloat16), compile=True)
    _assert_row_invariant(runner, 96, widths=[1, 3, 5])


def test_an_eager_and_a_compiled_runner_of_one_model_on_two_threads():
    """Runners of one model share its converted weights; what runs each block is fixed per runner, so
    an eager and a compiled runner on two threads at once give what each gives alone."""
    hf = tiny_hf("qwen2-tied", dtype=torch.bfloat16)
    runners = {"eager": load_runner(hf), "compiled": load_runner(hf, compile=True)}
    assert runners["eager"].model is runners["compiled"].model  # one conversion, shared
    gen = torch.Generator().manual_seed(3)
    prompt, tokens = torch.randint(96, (2, 7), generator=gen), torch.randint(96, (2, 5), generator=gen)

    def passes(runner):
        runner.cache.reset(2, 64)
        with torch.inference_mode():
            out = [runner.forward(prompt)[0]]
            for _ in range(6):
                out.append(runner.forward(tokens)[0])
                out.append(runner.forward(tokens[:, :1])[0])
        return out

    alone = {name: passes(r) for name, r in runners.items()}
    together, errors = {}, []

    def run(name):
        try:
            together[name] = passes(runners[name])
        except Exception as exc:  # noqa: BLE001 (re-raised below, on the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name in runners:
        assert all(torch.equal(a, b) for a, b in zip(alone[name], together[name], strict=True)), name


# -- the kernels themselves ------------------------------------------------------------------------

def _needs_packed(dtype):
    """PackedLinear in ``dtype`` exists on this processor: oneDNN has bfloat16 products only with
    AVX-512 (or AVX-NE-CONVERT); without, bfloat16 models take the panel products (test_cpu_ops.py)."""
    if not packable(torch.nn.Linear(8, 8).to(dtype)):
        pytest.skip("this processor's oneDNN has no bfloat16 products; PanelLinear serves bfloat16 here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner, bias", [(64, True), (1536, False)])  # from 1152 inputs one row sums differently
def test_packed_linear_rows_equal_each_row_alone(dtype, inner, bias):
    _needs_packed(dtype)
    torch.manual_seed(0)
    linear = torch.nn.Linear(inner, 96, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    packed.counts = checked_row_counts(packed)
    # every count to the first that failed here (all of them on an AMD EPYC; to 32 in bfloat16 on an
    # AMX Xeon, where 1536 inputs sum in another order from 33 rows on); the rows below must hold either way
    assert packed.counts == CHECKED_ROWS[:len(packed.counts)]
    x = torch.randn(300, inner).to(dtype)
    alone = torch.cat([packed(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in (1, 2, 3, 5, 16, 64, 70, 136, 300):  # 70, 136 and 300 run as products of checked counts
        assert torch.equal(packed(x[:rows]), alone[:rows]), rows
    assert packed(x[None, :5]).shape == (1, 5, 96)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(packed(x), linear(x), rtol=tol, atol=tol)


def test_a_shape_that_fails_the_row_check_runs_in_products_that_passed(monkeypatch):
    """A kernel whose products of 5 rows or more sum differently (as a processor's BLAS may) is caught
    by the row check and run 4 rows at a time, which keeps every row equal to its product alone."""
    torch.manual_seed(1)
    packed = PackedLinear(torch.nn.Linear(32, 24, bias=False))
    honest = PackedLinear.product
    monkeypatch.setattr(PackedLinear, "product", lambda self, flat: honest(self, flat) * (1 + 2**-20 * (flat.shape[0] >= 5)))
    monkeypatch.setattr("specdraft.runner.kernels._CHECKED_COUNTS", {})
    packed.counts = checked_row_counts(packed)
    assert packed.counts == (1, 2, 3, 4)
    x = torch.randn(11, 32)
    assert torch.equal(packed(x), torch.cat([packed(x[i:i + 1]) for i in range(11)]))


def test_the_row_check_catches_a_summation_order_that_random_rows_hardly_show(monkeypatch):
    """As oneDNN's AMX kernels do in bfloat16 from 33 rows on (see specdraft.runner.kernels): products
    of 5 rows or more that sum in another order (here: two halves of the inputs, then their sum, in
    float32) change a random bfloat16 row only now and then, since the result's rounding hides most of
    it; the check's cancelling rows (same shape, same kernel) show it, so the counts stop at 4."""
    _needs_packed(torch.bfloat16)
    init = PackedLinear.__init__

    def keep_weight(self, linear):
        init(self, linear)
        self.plain = linear.weight.detach().float()  # [out, in]

    def product(self, flat):  # elementwise products and sums over one axis: each row alone, whatever the count
        terms = flat.float()[:, None, :] * self.plain  # [rows, out, in]
        if flat.shape[0] < 5:
            return terms.sum(-1).to(self.dtype)
        return (terms[..., :32].sum(-1) + terms[..., 32:].sum(-1)).to(self.dtype)

    monkeypatch.setattr(PackedLinear, "__init__", keep_weight)
    monkeypatch.setattr(PackedLinear, "product", product)
    monkeypatch.setattr("specdraft.runner.kernels._CHECKED_COUNTS", {})
    torch.manual_seed(2)
    packed = PackedLinear(torch.nn.Linear(64, 24, bias=False).to(torch.bfloat16))
    packed.counts = checked_row_counts(packed)
    assert packed.counts == (1, 2, 3, 4)
    x = torch.randn(40, 64).to(torch.bfloat16)
    assert torch.equal(packed(x), torch.cat([packed(x[i:i + 1]) for i in range(40)]))


def test_pack_linears_replaces_float_cpu_linears_and_reports():
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4).double())
    panels = cpu_ops.panels_apply(model[0])  # float32 on a CPU with AVX-512: the extension's panels
    report = pack_linears(model)
    assert report == {"packed": 1} | ({"panels": 1} if panels else {})
    assert isinstance(model[0], cpu_ops.PanelLinear if panels else PackedLinear)
    assert type(model[2]) is torch.nn.Linear  # float64 is left alone
    x = torch.randn(3, 16)
    assert model[0](x).shape == (3, 8) and model[2](x[:, :8].double()).shape == (3, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (2, 2)])  # grouped, and one query head per KV head
def test_decode_attention_rows_do_not_depend_on_width_or_span(dtype, heads, kv_heads):
    gen = torch.Generator().manual_seed(2)
    dim, stored = 16, 40
    q = torch.randn(2, heads, 16, dim, generator=gen).to(dtype)
    keys, values = (torch.randn(2, kv_heads, 256, dim, generator=gen).to(dtype) for _ in range(2))
    positions = torch.arange(256)

    def attend(start, width, span):
        mask = (positions[:span][None, :] <= start + torch.arange(width)[:, None])[None, None].expand(2, 1, -1, -1)
        return decode_attention(q[:, :, start - stored:start - stored + width], keys[:, :, :span],
                                values[:, :, :span], mask, dim**-0.5)

    alone = torch.cat([attend(stored + i, 1, 64) for i in range(16)], dim=2)
    for width in WIDTHS:
        for span in (64, 128, 256):
            assert torch.equal(attend(stored, width, span), alone[:, :, :width]), (width, span)
    mask = (positions[:64][None, :] <= stored + torch.arange(16)[:, None])[None, None]
    expected = F.scaled_dot_product_attention(q.double(), keys[:, :, :64].double(), values[:, :, :64].double(),
                                              attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(alone.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, batch", [(9, 3, 1), (8, 1, 1), (4, 2, 2)])
def test_decode_attention_rows_over_long_spans(dtype, heads, kv_heads, batch):
    """Up to 32 tokens (96 query rows per KV head) over 1000 stored positions, in spans to 4096: one
    product of probabilities and values over the whole span sums in another order from 33 rows on (3
    with one KV head) on an AMX Xeon. Half the stored positions cancel the other half (equal keys,
    opposite large values), so a result is mostly rounding residue: any change of order shows."""
    gen = torch.Generator().manual_seed(7)
    dim, stored, width = 64, 1000, 32
    keys = torch.randn(batch, kv_heads, 4096, dim, generator=gen)
    values = torch.randn(batch, kv_heads, 4096, dim, generator=gen) * 2**-8
    pairs = torch.randperm(stored, generator=gen).reshape(2, -1)
    keys[:, :, pairs[1]] = keys[:, :, pairs[0]]
    values[:, :, pairs[0]] = torch.randn(batch, kv_heads, pairs.shape[1], dim, generator=gen) * 64
    values[:, :, pairs[1]] = -values[:, :, pairs[0]]
    q, keys, values = torch.randn(batch, heads, width, dim, generator=gen).to(dtype), keys.to(dtype), values.to(dtype)
    positions = torch.arange(4096)

    def attend(start, width, span):
        mask = (positions[:span][None, :] <= start + torch.arange(width)[:, None])[None, None].expand(batch, 1, -1, -1)
        return decode_attention(q[:, :, start - stored:start - stored + width], keys[:, :, :span],
                                values[:, :, :span], mask, dim**-0.5)

    def span_for(end):  # the runner's spans: powers of two
        return 1 << (end - 1).bit_length()

    alone = torch.cat([attend(stored + i, 1, span_for(stored + i + 1)) for i in range(width)], dim=2)
    for w in (*range(1, 17), 24, 32):
        for span in (span_for(stored + w), 4096):
            assert torch.equal(attend(stored, w, span), alone[:, :, :w]), (w, span)


def test_both_attention_forms_compute_attention():
    gen = torch.Generator().manual_seed(4)
    q, keys, values = (torch.randn(1, 4, 3, 8, generator=gen) for _ in range(3))
    keys, values = keys[:, :2].repeat(1, 1, 3, 1), values[:, :2].repeat(1, 1, 3, 1)  # 2 KV heads, 9 positions
    mask = torch.rand(1, 1, 3, 9, generator=gen) < 0.7
    mask[..., 0] = True
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(elementwise_attention(q, keys, values, mask, 8**-0.5), expected)
    got = grouped_attention(q.bfloat16(), keys.bfloat16(), values.bfloat16(), mask, 8**-0.5)
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("span", [64, 128, 300])  # one short block, one whole block, two and a short one
def test_grouped_attention_over_blocks_of_positions_computes_attention(span):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 5, 16, generator=gen)
    keys, values = (torch.randn(2, 3, span, 16, generator=gen) for _ in range(2))
    mask = (torch.rand(2, 1, 5, span, generator=gen) < 0.8) | (torch.arange(span) == 0)
    expected = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=mask,
                                              enable_gqa=True)
    got = grouped_attention(q.bfloat16(), keys.bfloat16(), values.bfloat16(), mask, 16**-0.5)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)
