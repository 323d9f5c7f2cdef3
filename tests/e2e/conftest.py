"""Real prompts for the default model's tests; the model itself (``default_f64``, ``default_f32``) is
loaded once per session by ``tests/conftest.py``."""

from __future__ import annotations

import pytest

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


#: Five more kinds (writing, math, translation, extraction, roleplay): with PROMPTS, the fixed subset
#: the bfloat16 parity tests run in one batch.
MORE_PROMPTS = {
    "writing": "Write a short poem about the sea at night.",
    "math": "A train travels 120 kilometres in 1.5 hours. What is its average speed? Explain each step.",
    "translation": "Translate into French: 'The library opens at nine and closes at six on weekdays.'",
    "extraction": "List every number in this sentence: 'In 2019, 45 students and 3 teachers visited 12 museums.'",
    "roleplay": "You are a tour guide in Rome. Greet a group of visitors and describe the plan for the day.",
}


@pytest.fixture(scope="session")
def days(default_f64):
    """A prompt whose answer repeats itself (drafts get accepted): ``.prompt``, ``.new`` (tokens its
    tests generate) and ``.plain``, plain greedy decoding of it as the user's message on the
    default model in float64 (tests/e2e/test_default_model.py checks that is transformers'),
    decoded once a session."""
    import types

    from specdraft import SpeculativeDecoder

    prompt, new = "List the days of the week, then list them again.", 32
    model, tokenizer = default_f64
    with SpeculativeDecoder(model, tokenizer, drafter="none") as dec:
        return types.SimpleNamespace(prompt=prompt, new=new, plain=dec.generate(prompt, max_new_tokens=new)[0])


@pytest.fixture(scope="session")
def prompts():
    return PROMPTS


@pytest.fixture(scope="session")
def eight_prompts():
    return PROMPTS | MORE_PROMPTS


@pytest.fixture
def cli(capsys, monkeypatch, cached_default_model):
    """``cli(*args, stdin=None)``: ``specdraft ARGS`` run in this process on the session's loaded
    default model; returns ``(exit code, stdout, stderr)``."""
    import io

    from specdraft.cli import main

    def run(*args, stdin=None):
        if stdin is not None:
            monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's own usage errors
            code = exc.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
