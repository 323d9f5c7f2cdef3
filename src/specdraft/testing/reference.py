"""References written without specdraft's code: what plain decoding gives."""

from __future__ import annotations

from typing import Sequence


def plain_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers' own greedy ``generate`` (no specdraft code involved)."""
    import torch

    out = model.generate(
        torch.tensor([list(prompt)], device=model.device), max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def naive_penalized_greedy(model, prompt: Sequence[int], max_new_tokens: int, params) -> list[int]:
    """Reference for greedy decoding with penalties, written out token by token with no
    specdraft code: a full forward per step, then transformers' repetition penalty and
    OpenAI's presence and frequency penalties on that step's logits, then the argmax."""
    from collections import Counter

    import torch

    tokens, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([tokens], device=model.device)).logits[0, -1].double().tolist()
            for t in set(tokens):
                logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * params.repetition_penalty
            for t, c in Counter(out).items():
                logits[t] -= params.presence_penalty + params.frequency_penalty * c
            best = max(range(len(logits)), key=lambda i: (logits[i], -i))
            tokens.append(best)
            out.append(best)
    return out


def exact_joint_distribution(model, prompt: Sequence[int], params, steps: int = 2):
    """P(first ``steps`` tokens) under plain sampling from ``model``, by enumeration.

    The model computes its logits in its own dtype (bfloat16 stays bfloat16); the sampling
    pipeline and the products run in float64, penalties reading each step's own context.
    Returns a ``[vocab] * steps`` tensor; practical for vocabularies of a few dozen tokens.
    """
    import itertools

    import torch

    from ..sampling import TokenCounts, logits_to_probs

    vocab = model.config.vocab_size
    joint = torch.zeros([vocab] * steps, dtype=torch.float64)
    start = TokenCounts.of([list(prompt)], [len(prompt)], vocab)
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=steps - 1):
            ids = torch.tensor([list(prompt) + list(seq)], device=model.device)
            logits = model(ids).logits[0, len(prompt) - 1 :].cpu().double()  # [steps, vocab]
            counts = start.along(torch.tensor([list(seq)], dtype=torch.long))
            probs = logits_to_probs(logits[None], params, counts)[0]  # [steps, vocab]
            prefix = 1.0
            for i, t in enumerate(seq):
                prefix *= float(probs[i, t])
            joint[seq] = prefix * probs[steps - 1]
    return joint


