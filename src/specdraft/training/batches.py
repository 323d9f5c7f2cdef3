"""Training batches of the heads: padding sequences with their target states, and EAGLE unrolled.

Shared by the heads' training (:mod:`.heads`), the copy gate's (:mod:`.copy_gate`) and the
held-out check (:mod:`.evaluate`), which therefore need not import one another.
"""

from __future__ import annotations

import torch


def padded_batch(seqs: list[dict], states: list[torch.Tensor], dtype, device):
    """Pad a batch: ids ``[B, W]``, states ``[B, W, H]``, valid ``[B, W]`` and answer ``[B, W]`` masks."""
    width = max(len(s["ids"]) for s in seqs)
    batch = len(seqs)
    ids = torch.zeros((batch, width), dtype=torch.long)
    feats = torch.zeros((batch, width, states[0].shape[-1]), dtype=dtype)
    valid = torch.zeros((batch, width), dtype=torch.bool)
    answer = torch.zeros((batch, width), dtype=torch.bool)
    for b, (s, f) in enumerate(zip(seqs, states)):
        n = len(s["ids"])
        ids[b, :n] = torch.tensor(s["ids"])
        feats[b, :n] = f.to(dtype)
        valid[b, :n] = True
        answer[b, s["prompt_len"] : n] = True
    return ids.to(device), feats.to(device), valid.to(device), answer.to(device)


def _chain_mask(steps: torch.Tensor, chains: torch.Tensor, dtype, device) -> torch.Tensor:
    """Additive mask ``[1, 1, N, N]`` of the ``N`` pairs of an unrolled EAGLE pass (see :func:`eagle_unroll`).

    Item ``a`` = (step ``s_a``, chain ``c_a``) sees true pairs (step 1) up to its chain's start
    ``c_b <= c_a``, and its own chain's guessed pairs of steps ``<= s_a``: what drafting sees.
    """
    s_a, s_b = steps[:, None], steps[None, :]
    c_a, c_b = chains[:, None], chains[None, :]
    visible = ((s_b == 1) & (c_b <= c_a)) | ((s_b >= 2) & (c_b == c_a) & (s_b <= s_a))
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


class _EarlierPairs:
    """The keys and values of the pairs an unrolled pass has run so far, gradients included, so
    that each step runs only its new pairs (the one method of transformers' ``Cache`` that its
    attention calls)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [B, kv_heads, N, head_dim]
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=-2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=-2)
        return self.keys, self.values


def eagle_unroll(module, embeddings, ids, feats, depth: int, noise: float = 0.0,
                 generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """EAGLE drafting ``depth`` steps deep from every position at once, as the drafter runs it.

    ``ids # [B, W]``, ``feats # [B, W, H]`` (``n = W - 1`` pairs). Returns ``guesses`` with
    ``guesses[s-1] # [B, n-s+1, H]``: entry ``j`` is the guess of ``f_{j+s}`` by the chain that
    starts after the true pairs ``0..j`` (pair ``t = (f_t, x_{t+1})``) and is then fed its own
    guessed features with the tokens ``x_{j+2}..x_{j+s}``; its token guess is ``x_{j+s+1}``.
    Step 1 is one pass over the true pairs; step ``s`` one pass over its new guessed pairs,
    which attend to the keys and values of every pair before them under :func:`_chain_mask`'s
    rows (so that training sees exactly what drafting sees; a test checks it against the
    drafter's cache path). ``noise``: uniform noise of that size on the true features, drawn
    from ``generator``.
    """
    batch, width = ids.shape
    n = width - 1
    device = feats.device
    true_in = feats[:, :-1]
    if noise:
        uniform = torch.rand(true_in.shape, generator=generator, dtype=true_in.dtype, device=true_in.device)
        true_in = true_in + (uniform * 2 - 1) * noise
    earlier = _EarlierPairs()
    steps, chains = [], []
    guesses: list[torch.Tensor] = []
    for s in range(1, depth + 1):
        m = n - s + 1  # chains that reach step s
        if m <= 0:
            break
        if s == 1:
            f_in, x_in = true_in, embeddings(ids[:, 1:])
        else:
            f_in, x_in = guesses[-1][:, :m], embeddings(ids[:, s : s + m])  # guess of f_{j+s-1}, and x_{j+s}
        positions = torch.arange(m, device=device) + s - 1
        steps.append(torch.full((m,), s, dtype=torch.long, device=device))
        chains.append(torch.arange(m, device=device))
        mask = _chain_mask(torch.cat(steps), torch.cat(chains), feats.dtype, device)[:, :, -m:]  # [1, 1, m, all]
        guesses.append(module(f_in, x_in, positions[None].expand(batch, -1), mask, past_key_values=earlier))
    return guesses


def eagle3_features(module, feats: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's fused features ``g_t = fc([a_t ; b_t ; c_t])`` from states whose first columns are
    the target's states at ``module.aux_layers`` side by side (:func:`~.data.target_features` with
    those layers; the final-norm state that training appends after them is left out).
    ``# [..., k * H_target (+ H)] -> [..., H]``"""
    return module.fc(feats[..., : module.fc.in_features].to(module.fc.weight.dtype))


__all__ = ["eagle3_features", "eagle_unroll", "padded_batch"]
