"""Helpers for testing drafters, built-in or third-party.

``check_drafter`` is the conformance suite: run any drafter through it with a small
model (see :func:`tiny_llama`) and it checks the Draft contract, rollback after partial
acceptance, greedy parity with plain decoding (in one batch, and as sequences join and leave
a running batch), and that sampling follows the target's distribution::

    from specdraft.testing import check_drafter, tiny_llama
    check_drafter("my-drafter", tiny_llama())
"""

from __future__ import annotations

from .conformance import (PIPELINE, check_continuous_batching, check_drafter, continuous_requests,
                          recorded_proposals)
from .drafters import TargetDrafter
from .models import (RunnerAsModel, differing_widths, gated_draft, on_one_thread, random_heads, repetitive_prompts, tiny_llama,
                     tiny_tokenizer, trusting_copy_gate, wide_bf16_llama)
from .reference import (Enumerated, enumerate_plain_sampling, exact_joint_distribution, naive_penalized_greedy,
                        plain_greedy, reference_probs)
from .stats import EFFECT, POWER, SIGNIFICANCE, chi_square_pvalue, sampled_joint_pvalue, samples_needed, samples_pvalue

__all__ = [
    "EFFECT", "Enumerated", "PIPELINE", "POWER", "RunnerAsModel", "SIGNIFICANCE", "TargetDrafter", "enumerate_plain_sampling",
    "reference_probs", "samples_needed", "samples_pvalue", "check_continuous_batching", "check_drafter", "chi_square_pvalue",
    "continuous_requests", "differing_widths", "exact_joint_distribution", "gated_draft", "naive_penalized_greedy", "on_one_thread", "plain_greedy", "random_heads",
    "recorded_proposals", "repetitive_prompts", "sampled_joint_pvalue", "tiny_llama", "tiny_tokenizer",
    "trusting_copy_gate", "wide_bf16_llama",
]
