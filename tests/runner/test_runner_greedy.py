"""Greedy decoding with our model and cache equals transformers' generate."""

from __future__ import annotations

import torch

from specdraft.runner import from_transformers
from specdraft.testing import plain_greedy, repetitive_prompts, tiny_llama


@torch.no_grad()
def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding of a ragged batch: one prefill, then one token per row per pass."""
    lens = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    cache = model.new_cache(slots=len(prompts), max_len=int(lens.max()) + new_tokens)
    logits = model(tokens, cache, logits_at=(lens - 1)[:, None], advance=lens).logits  # [B, 1, vocab]
    out = []
    for _ in range(new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        out.append(nxt)
        logits = model(nxt, cache).logits
    return torch.cat(out, dim=1).tolist()


def test_greedy_equals_transformers_generate():
    hf = tiny_llama(vocab_size=64, seed=0)
    model, reason = from_transformers(hf)
    assert model is not None, reason
    prompts = repetitive_prompts(64, seed=0)[:3]
    assert len({len(p) for p in prompts}) > 1  # ragged
    expected = [plain_greedy(hf, p, 20) for p in prompts]
    assert greedy(model, prompts, 20) == expected
    assert greedy(model, prompts[1:2], 20) == expected[1:2]
