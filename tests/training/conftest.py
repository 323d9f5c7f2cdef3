"""Shared by the training tests: a tiny random model built for the default target's tokenizer
(``smol_tokenizer``, from tests/conftest.py: a real chat template), also saved as a folder the
CLI can load."""

from __future__ import annotations

import json

import pytest

from specdraft.testing import tiny_llama


@pytest.fixture(scope="session")
def tiny_target(smol_tokenizer):
    """A 2-layer random Llama over the default tokenizer's vocabulary."""
    return tiny_llama(vocab_size=len(smol_tokenizer), seed=5, max_positions=512)


@pytest.fixture(scope="session")
def tiny_target_dir(tiny_target, smol_tokenizer, tmp_path_factory):
    """:func:`tiny_target` and the tokenizer saved as a model folder, for ``--target``."""
    folder = tmp_path_factory.mktemp("tiny-target")
    tiny_target.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def qa_file(tmp_path):
    """Six GSM8K-style prompts with reference answers."""
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"<<{i}+{i}>>It is {2 * i}."})
                              for i in range(6)) + "\n")
    return path
