"""Every registered drafter (built-in or installed plugin) through the conformance suite."""

from __future__ import annotations

import pytest

from specdraft.plugins import get_registry
from specdraft.testing import check_drafter


@pytest.mark.parametrize("name", get_registry().names())
def test_registered_drafter_conforms(tiny_model, name):
    check_drafter(name, tiny_model)
