"""The runner's fixtures: tiny random transformers models of each supported architecture
(built by :mod:`specdraft.testing.architectures`, which test modules import directly)."""

from __future__ import annotations

import pytest

from specdraft.testing.architectures import tiny_config, tiny_hf


@pytest.fixture(scope="session")
def hf_factory():
    """``hf_factory(kind, seed=0, dtype=None)``: a random transformers model (see ``tiny_hf``)."""
    return tiny_hf


@pytest.fixture(scope="session")
def config_factory():
    """``config_factory(kind, **overrides)``: its config alone (see ``tiny_config``)."""
    return tiny_config
