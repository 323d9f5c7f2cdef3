"""Shared fixtures: tiny float64 models for unit tests, the real default model for e2e."""

from __future__ import annotations

import os

# Tests never reach the network: a hub id that is not cached fails at once instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from specdraft.testing import tiny_llama  # noqa: E402



@pytest.fixture(scope="session")
def tiny_model():
    """Random 2-layer Llama, vocab 64, float64 (greedy ties cannot flip)."""
    return tiny_llama(vocab_size=64, seed=0)


@pytest.fixture(scope="session")
def small_vocab_model():
    """Random Llama with a 16-token vocabulary, for enumerating exact distributions."""
    model = tiny_llama(vocab_size=16, seed=1)
    with torch.no_grad():  # sharpen it a little so the distributions are not near-uniform
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture
def register_plugin():
    """Register a plugin object for one test; always unregistered afterwards."""
    from specdraft.plugins import pm

    registered = []

    def _register(plugin, name):
        pm.register(plugin, name=name)
        registered.append(plugin)
        return plugin

    try:
        yield _register
    finally:
        for plugin in registered:
            pm.unregister(plugin)
