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
    """Additive mask ``[1, 1, N, N]`` of an unrolled EAGLE pass (see :func:`eagle_unroll`).

    Item ``a`` = (step ``s_a``, chain ``c_a``) sees true pairs (step 1) up to its chain's start
    ``c_b <= c_a``, and its own chain's guessed pairs of steps ``<= s_a``: what drafting sees.
    """
    s_a, s_b = steps[:, None], steps[None, :]
    c_a, c_b = chains[:, None], chains[None, :]
    visible = ((s_b == 1) & (c_b <= c_a)) | ((s_b >= 2) & (c_b == c_a) & (s_b <= s_a))
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def eagle_unroll(module, embeddings, ids, feats, depth: int, noise: float = 0.0,
                 generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """EAGLE drafting ``depth`` steps deep from every position at once, as the drafter runs it.

    ``ids # [B, W]``, ``feats # [B, W, H]`` (``n = W - 1`` pairs). Returns ``guesses`` with
    ``guesses[s-1] # [B, n-s+1, H]``: entry ``j`` is the guess of ``f_{j+s}`` by the chain that
    starts after the true pairs ``0..j`` (pair ``t = (f_t, x_{t+1})``) and is then fed its own
    guessed features with the tokens ``x_{j+2}..x_{j+s}``; its token guess is ``x_{j+s+1}``.
    Step ``s`` is one pass over the true pairs and the guessed pairs of steps ``2..s``, with
    :func:`_chain_mask` (so that training sees exactly what drafting sees; a test checks it
    against the drafter's cache path). ``noise``: uniform noise of that size on the true
    features, drawn from ``generator``.
    """
    batch, width = ids.shape
    n = width - 1
    device = feats.device
    true_in = feats[:, :-1]
    if noise:
        uniform = torch.rand(true_in.shape, generator=generator, dtype=true_in.dtype, device=true_in.device)
        true_in = true_in + (uniform * 2 - 1) * noise
    f_in, x_in = [true_in], [embeddings(ids[:, 1:])]
    positions, steps, chains = [torch.arange(n, device=device)], [torch.ones(n, dtype=torch.long, device=device)], \
        [torch.arange(n, device=device)]
    guesses: list[torch.Tensor] = []
    for s in range(1, depth + 1):
        m = n - s + 1  # chains that reach step s
        if m <= 0:
            break
        if s > 1:
            f_in.append(guesses[-1][:, :m])  # guess of f_{j+s-1}
            x_in.append(embeddings(ids[:, s : s + m]))  # x_{j+s}
            positions.append(torch.arange(m, device=device) + s - 1)
            steps.append(torch.full((m,), s, dtype=torch.long, device=device))
            chains.append(torch.arange(m, device=device))
        pos = torch.cat(positions)
        mask = _chain_mask(torch.cat(steps), torch.cat(chains), feats.dtype, device)
        out = module(torch.cat(f_in, 1), torch.cat(x_in, 1), pos[None].expand(batch, -1), mask)
        guesses.append(out[:, -m:])
    return guesses


__all__ = ["eagle_unroll", "padded_batch"]
