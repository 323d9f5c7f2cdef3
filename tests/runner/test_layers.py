"""LayerRunner: transformers decoder layers on specdraft's blocks over the runner's KV cache equal
transformers' own layers (float64), eager and compiled, through ragged passes and rollbacks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from specdraft.runner.layers import LayerRunner, layers_from_transformers
from specdraft.testing.architectures import KINDS

ATOL = 1e-10  # float64: the two paths differ only by summation order
#: compiled against eager: the norms normalise in float32 (as transformers' do), and the compiled
#: kernel's float32 rsqrt may differ from eager's by an ulp, which moves a position by ~1e-7
COMPILED_ATOL = 1e-6
DIM = 64


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


def layer_config(**overrides):
    from transformers import LlamaConfig

    values = dict(hidden_size=DIM, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, vocab_size=96, num_hidden_layers=1)
    config = LlamaConfig(**values | overrides)
    config._attn_implementation = "sdpa"
    return config


def randomize(module, seed):
    """Weights far from transformers' init (norm weights 1), so a missed term shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
            p.copy_(1 + 0.3 * noise if p.ndim == 1 else noise / math.sqrt(p.shape[1]))


class Layer:
    """A random transformers ``LlamaDecoderLayer`` (EAGLE-1's, without its input norm, when
    ``attention_norm`` is False) and its output over whole sequences, no cache."""

    def __init__(self, attention_norm: bool, seed: int = 0, **config):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        torch.manual_seed(seed)
        self.config = layer_config(**config)
        self.layer = LlamaDecoderLayer(self.config, layer_idx=0)
        if not attention_norm:
            self.layer.input_layernorm = nn.Identity()
        randomize(self.layer, seed)
        self.layer.to(torch.float64).eval()
        self.rotary = LlamaRotaryEmbedding(self.config)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x # [T, dim]`` -> the layer's output at every position, causally.  # [T, dim]"""
        n = x.shape[0]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
        out = self.layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x[None], pos))
        return (out[0] if isinstance(out, tuple) else out)[0]


def runner_for(layer: Layer, attention_norm: bool, compile: bool = False) -> LayerRunner:
    runner, reason = layers_from_transformers(layer.layer, layer.config, attention_norm=attention_norm,
                                              compile=compile)
    assert reason == "" and isinstance(runner, LayerRunner)
    return runner


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_model_layers_equal_transformers(hf_factory, kind):
    """Every supported architecture's layers (llama3 rope, Mistral's window, Qwen2's q/k/v bias,
    Qwen3's q/k norms and head_dim) run over ragged rows as the whole model runs them."""
    hf = hf_factory(kind)
    runner, reason = layers_from_transformers(hf.model.layers, hf.config)
    assert reason == "" and runner.model.args.n_layers == 2
    seen = []
    hook = hf.model.norm.register_forward_hook(lambda module, args, out: seen.append(args[0][0]))

    def reference(seq):  # input of the final norm: the last layer's output  # [T, dim]
        seen.clear()
        hf(torch.tensor([seq]))
        return seen[0]

    gen = torch.Generator().manual_seed(1)
    lens = [7, 3, 11]
    seqs = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in lens]
    tokens = torch.zeros(3, 11, dtype=torch.long)
    for b, seq in enumerate(seqs):
        tokens[b, : len(seq)] = torch.tensor(seq)
    embed = hf.get_input_embeddings()
    runner.cache.reset(3, 40)
    out = runner.forward(embed(tokens), advance=lens)
    assert runner.cache.lengths.tolist() == lens
    for b, seq in enumerate(seqs):
        close(out[b, : len(seq)], reference(seq))
    for width in (1, 4, 1, 4):  # past Mistral's window of 5
        new = torch.randint(1, 96, (3, width), generator=gen)
        out = runner.forward(embed(new))
        assert out.shape == (3, width, DIM) and out.dtype == torch.float64
        for b in range(3):
            seqs[b] += new[b].tolist()
            close(out[b], reference(seqs[b])[-width:])
    hook.remove()


def _drafting_rounds(runner: LayerRunner, layer: Layer, gen: torch.Generator, atol: float = ATOL):
    """What EAGLE's drafter does, checked against ``layer`` at every step: ragged catch-ups of
    true inputs (rows padded, each advancing by its own count), one-token steps on guesses,
    rollbacks to the true inputs. Returns each row's true inputs and the outputs seen."""
    rows = 3
    true = [torch.zeros(0, DIM, dtype=torch.float64) for _ in range(rows)]
    seen = []
    runner.cache.reset(rows, 8)  # small: the rounds grow it (reserve)
    for counts in ([5, 2, 4], [1, 3, 2], [1, 1, 1], [0, 2, 1], [4, 1, 3]):
        runner.cache.set_lengths([len(t) for t in true])  # forget the guesses
        runner.cache.reserve(max(len(t) for t in true) + max(counts) + 3)
        width = max(counts)
        x = torch.zeros(rows, width, DIM, dtype=torch.float64)
        for b, n in enumerate(counts):
            x[b, :n] = torch.randn(n, DIM, generator=gen, dtype=torch.float64)
            true[b] = torch.cat([true[b], x[b, :n]])
        even = len(set(counts)) == 1
        out = runner.forward(x, advance=None if even else counts)
        assert out.shape == (rows, width, DIM)
        assert runner.cache.lengths.tolist() == [len(t) for t in true]
        seen.append(out)
        feeds = [t.clone() for t in true]
        for b, n in enumerate(counts):
            if n:
                close(out[b, :n], layer(true[b])[-n:], atol)
        for _ in range(2):  # guessed inputs, one position per row
            step = torch.randn(rows, 1, DIM, generator=gen, dtype=torch.float64)
            out = runner.forward(step)
            seen.append(out)
            for b in range(rows):
                feeds[b] = torch.cat([feeds[b], step[b]])
                close(out[b, 0], layer(feeds[b])[-1], atol)
    runner.cache.set_lengths([len(t) for t in true])
    return true, seen


@pytest.mark.parametrize("attention_norm", [False, True])
@torch.no_grad()
def test_ragged_catch_ups_steps_and_rollbacks_equal_transformers(attention_norm):
    layer = Layer(attention_norm, seed=3)
    runner = runner_for(layer, attention_norm)
    if not attention_norm:
        assert isinstance(runner.model.layers[0].attention_norm, nn.Identity)
    true, _ = _drafting_rounds(runner, layer, torch.Generator().manual_seed(0))
    # the cache after all the rollbacks holds what one fresh pass over the true inputs stores
    fresh = runner_for(layer, attention_norm)
    fresh.cache.reset(3, 64)
    width = max(len(t) for t in true)
    x = torch.zeros(3, width, DIM, dtype=torch.float64)
    for b, t in enumerate(true):
        x[b, : len(t)] = t
    fresh.forward(x, advance=[len(t) for t in true])
    assert torch.equal(fresh.cache.lengths, runner.cache.lengths)
    for mine, ref in zip(runner.cache.kv.keys + runner.cache.kv.values, fresh.cache.kv.keys + fresh.cache.kv.values):
        for b, t in enumerate(true):
            close(mine[b, :, : len(t)], ref[b, :, : len(t)])


@pytest.mark.parametrize("attention_norm", [False, True])
@torch.no_grad()
def test_compiled_equals_eager(attention_norm):
    """compile=True pads each pass to its width bucket (1, 2, 4, 8 here) through the compiled
    block; the padding is cut and never attended to."""
    layer = Layer(attention_norm, seed=4)
    eager, compiled = runner_for(layer, attention_norm), runner_for(layer, attention_norm, compile=True)
    assert compiled.compiled and compiled.info["compiled"] and eager._compiled_block is None
    widths = []  # of the passes through the compiled block: a fallback to eager would leave it empty
    block = compiled._block_fn
    compiled._block_fn = lambda module, x, *rest: widths.append(x.shape[1]) or block(module, x, *rest)
    true_e, seen_e = _drafting_rounds(eager, layer, torch.Generator().manual_seed(1))
    true_c, seen_c = _drafting_rounds(compiled, layer, torch.Generator().manual_seed(1), COMPILED_ATOL)
    assert len(seen_c) == len(seen_e)
    for a, b in zip(seen_c, seen_e):
        assert a.shape == b.shape  # padded to the bucket, cut back
        close(a, b, COMPILED_ATOL)
    assert torch.equal(compiled.cache.lengths, eager.cache.lengths)
    # every pass (one layer: one block call each) ran compiled, padded to its bucket
    assert len(widths) == len(seen_c) and sorted(set(widths)) == [1, 2, 4, 8]
    for mine, ref in zip(compiled.cache.kv.keys + compiled.cache.kv.values, eager.cache.kv.keys + eager.cache.kv.values):
        for b, t in enumerate(true_e):
            close(mine[b, :, : len(t)], ref[b, :, : len(t)], COMPILED_ATOL)


def test_llama3_rope_and_shared_weights():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    layer = Layer(False, seed=5, rope_parameters=rope)
    runner = runner_for(layer, False)
    assert runner.model.args.rope_llama3 == (8.0, 1.0, 4.0, 16)
    block, attn = runner.model.layers[0], layer.layer.self_attn
    assert block.attention.wo.weight.data_ptr() == attn.o_proj.weight.data_ptr()  # shared, not copied
    assert not any(p.requires_grad for p in runner.model.parameters())
    runner.cache.reset(1, 40)
    x = torch.randn(1, 30, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        close(torch.cat([runner.forward(x[:, :20]), runner.forward(x[:, 20:])], dim=1)[0], layer(x[0]))


@pytest.mark.parametrize("make,words", [
    (lambda: layers_from_transformers(Layer(False).layer, layer_config()), "pass attention_norm=False"),
    (lambda: layers_from_transformers(Layer(True, hidden_act="gelu").layer, layer_config(hidden_act="gelu")),
     "LlamaDecoderLayer uses hidden_act='gelu'"),
    (lambda: layers_from_transformers(Layer(True).layer, layer_config(rope_parameters={"rope_type": "linear",
                                                                                        "rope_theta": 1e4,
                                                                                        "factor": 2.0})),
     "rope_type='linear'"),
    (lambda: layers_from_transformers(nn.Linear(4, 4), layer_config()), "Linear is not a supported decoder layer"),
    (lambda: layers_from_transformers([], layer_config()), "no decoder layers"),
])
def test_refusals_name_the_reason(make, words):
    runner, reason = make()
    assert runner is None and words in reason and "\n" not in reason
