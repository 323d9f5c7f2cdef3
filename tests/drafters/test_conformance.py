"""Every registered drafter (built-in or installed plugin) through the conformance suite."""

from __future__ import annotations

import pytest

from specdraft import SpeculativeDecoder
from specdraft.errors import ConfigError, ModelLoadError
from specdraft.plugins import get_registry
from specdraft.testing import check_drafter


@pytest.mark.parametrize("name", get_registry().names())
def test_registered_drafter_conforms(tiny_model, name):
    try:
        SpeculativeDecoder(tiny_model, None, drafter=name)
    except (ConfigError, ModelLoadError) as exc:
        pytest.skip(f"{name} cannot start on the tiny model without options ({exc}); "
                    "its own test module runs the suite with them")
    check_drafter(name, tiny_model)
