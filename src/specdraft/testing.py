"""Helpers for testing drafters, built-in or third-party.

``check_drafter`` is the conformance suite: run any drafter through it with a small
model (see :func:`tiny_llama`) and it checks the Draft contract, rollback after partial
acceptance, and greedy parity with plain decoding::

    from specdraft.testing import check_drafter, tiny_llama
    check_drafter("my-drafter", tiny_llama())
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

#: Significance level of specdraft's statistical tests. Their seeds are fixed, so a run is
#: deterministic; the level says how far from the target a sampler may drift and still pass.
SIGNIFICANCE = 1e-3


def tiny_llama(vocab_size: int = 64, seed: int = 0, layers: int = 2, max_positions: int = 256, dtype=None):
    """A small random Llama (float64 by default, so greedy ties cannot flip between paths)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype or torch.float64).eval()


def trusting_copy_gate(hidden: int, match_bias: float = 2.0, dtype=None):
    """A :class:`~specdraft.drafters.copy_gate.CopyGate` that often trusts its candidate (2- and
    3-gram matches) and mostly not (1-gram matches), so both halves of the mixture get drafted."""
    import torch

    from .drafters.copy_gate import CopyGate

    gate = CopyGate(hidden).to(dtype or torch.float32)
    with torch.no_grad():
        gate.match.weight.fill_(match_bias)
        gate.match.weight[1] = -match_bias
        gate.agree.fill_(0.5)
    return gate


def random_heads(kind: str, model, path, seed: int = 0, head_ids=None, scale: float = 0.5, copy_gate: bool = False,
                 **config):
    """Save randomly initialised heads of ``kind`` for ``model`` into ``path`` (specdraft's format).

    ``scale`` is the std of the random weights (Medusa's blocks start at identity otherwise);
    ``head_ids`` trims the vocabulary; ``copy_gate`` adds a :func:`trusting_copy_gate`. Returns ``path``.
    """
    import torch

    from .drafters.compact_draft import target_fingerprint
    from .drafters.heads.formats import save_heads
    from .drafters.heads.modules import SharedHead, build_heads

    torch.manual_seed(seed)
    module = build_heads(kind, model.config.get_text_config(), **config).to(model.dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, scale / p.shape[1] ** 0.5 * 3)
    if copy_gate:
        module.copy_gate = trusting_copy_gate(model.config.get_text_config().hidden_size, dtype=model.dtype)
    vocab = model.get_output_embeddings().weight.shape[0]
    shared = SharedHead(model.get_output_embeddings(), vocab, head_ids)
    return save_heads(module, shared, path, "tiny", target_fingerprint(model.get_input_embeddings().weight),
                      dtype=model.dtype)


def plain_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers' own greedy ``generate`` (no specdraft code involved)."""
    import torch

    out = model.generate(
        torch.tensor([list(prompt)], device=model.device), max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def repetitive_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats (so copy-style drafters get accepted) and of different lengths."""
    import random

    rng = random.Random(seed)
    motif = [rng.randrange(vocab_size) for _ in range(5)]
    return [
        motif * 3 + motif[:2],
        [rng.randrange(vocab_size) for _ in range(11)],
        [rng.randrange(vocab_size)],
        (motif[::-1] * 2)[:7],
    ]


def check_drafter(
    drafter: str | Any,
    model,
    drafter_options: Mapping[str, Any] | None = None,
    spec_lengths: Sequence[int] = (1, 3, 5),
    max_new_tokens: int = 24,
) -> None:
    """Conformance suite; raises ``AssertionError`` describing the first violation.

    * every proposal is a valid Draft (shape, dtype, token range, probability rows);
    * batched greedy speculative decoding equals transformers' plain greedy decoding for
      every K in ``spec_lengths`` -- which also covers rollback after partial acceptance;
    * a second call on the same decoder gives the same output (``reset`` works).
    """
    from .decoder import SpeculativeDecoder
    from .verifier import check_draft

    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = repetitive_prompts(vocab)
    expected = [plain_greedy(model, p, max_new_tokens) for p in prompts]
    for k in spec_lengths:
        dec = SpeculativeDecoder(model, None, drafter=drafter, spec_length=k, drafter_options=drafter_options)
        inner, proposals = dec.drafter.propose, []

        def spy(ctx, kk, _inner=inner, _proposals=proposals):
            draft = _inner(ctx, kk)
            _proposals.append((draft, ctx.batch_size, kk))
            return draft

        dec.drafter.propose = spy
        try:
            got = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=max_new_tokens)]
        finally:
            del dec.drafter.propose
        for draft, batch, kk in proposals:
            check_draft(draft, batch, kk, vocab, repr(dec.drafter.name), model.device)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"K={k}, prompt {i}: speculative output differs from plain greedy\n  got      {g}\n  expected {e}"
        again = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=max_new_tokens)]
        assert again == got, f"K={k}: a second generate call on the same decoder gave different output"


def exact_joint_distribution(model, prompt: Sequence[int], params, steps: int = 2):
    """P(first ``steps`` tokens) under plain sampling from ``model``, by enumeration.

    Returns a ``[vocab] * steps`` tensor; practical for vocabularies of a few dozen tokens.
    """
    import itertools

    import torch

    from .sampling import logits_to_probs

    vocab = model.config.vocab_size
    joint = torch.zeros([vocab] * steps, dtype=torch.float64)
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=steps - 1):
            ids = torch.tensor([list(prompt) + list(seq)])
            logits = model(ids).logits[0, len(prompt) - 1 :]  # [steps, vocab]
            probs = logits_to_probs(logits, params)
            prefix = 1.0
            for i, t in enumerate(seq):
                prefix *= float(probs[i, t])
            joint[seq] = prefix * probs[steps - 1]
    return joint


def chi_square_pvalue(observed, expected_probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value (cells with small expectation are pooled)."""
    import torch

    observed = torch.as_tensor(observed, dtype=torch.float64).flatten()
    probs = torch.as_tensor(expected_probs, dtype=torch.float64).flatten()
    n = observed.sum()
    expected = probs * n
    if bool((observed[expected == 0] > 0).any()):
        return 0.0  # a sample where the target puts no mass: certainly wrong
    big = expected >= min_expected
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))
