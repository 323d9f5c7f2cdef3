"""Chi-square p-value of one speculative position sampled from bfloat16 logits, as the verifier does it.

The target's logits are bfloat16 (what a GPU loads by default); the verifier turns them into
probabilities with ``specdraft.sampling.logits_to_probs`` and accepts drafts with
``rejection_sample``. The emitted token must follow softmax(logits) exactly: the reference here
is that softmax computed in float64 from the same bfloat16 logits.

    .venv/bin/python benchmarks/bf16_exactness.py [--samples 2000000]

Run it against another checkout with PYTHONPATH=OTHER/src to compare.
"""

from __future__ import annotations

import argparse

import torch

from specdraft.sampling import SamplingParams, logits_to_probs
from specdraft.testing import chi_square_pvalue
from specdraft.verifier import rejection_sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2_000_000)
    parser.add_argument("--vocab", type=int, default=32)
    args = parser.parse_args()
    n, vocab = args.samples, args.vocab
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(vocab, generator=g) * 2).to(torch.bfloat16)  # the target's, in its dtype
    logits[0] = logits.max() + 6  # a confident top token: where bfloat16 rounding bites
    params = SamplingParams(temperature=1.0)
    exact = logits.double().softmax(-1)
    target = logits_to_probs(torch.stack([logits, logits])[None], params)  # [1, 2, vocab], as the verifier
    print(f"top probability {float(exact[0]):.5f}; probabilities in {target.dtype}; {n:,} samples per row")
    draft_logits = torch.randn(vocab, generator=g)
    for name, draft_ids, draft_probs in [
        ("one-hot draft of the top token", torch.zeros((n, 1), dtype=torch.long), None),
        ("sampled draft", None, logits_to_probs(draft_logits, params)),
    ]:
        if draft_ids is None:
            draft_ids = torch.multinomial(draft_probs, n, replacement=True, generator=g)[:, None]
            draft_probs = draft_probs[None, None].expand(n, 1, vocab)
        num, nxt = rejection_sample(draft_ids, torch.ones(n, dtype=torch.long), draft_probs,
                                    target.expand(n, 2, vocab), g)
        first = torch.where(num > 0, draft_ids[:, 0], nxt)
        pvalue = chi_square_pvalue(torch.bincount(first, minlength=vocab), exact)
        print(f"{name:32s} chi-square p = {pvalue:.3g}")


if __name__ == "__main__":
    main()
