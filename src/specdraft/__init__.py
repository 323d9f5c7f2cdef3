"""specdraft: exact speculative decoding with pluggable drafters."""

import importlib.metadata as _metadata

from .decoder import SpeculativeDecoder
from .drafters.api import Drafter
from .errors import (
    ConfigError,
    DrafterError,
    ModelLoadError,
    PluginError,
    SpecdraftError,
    UnknownDrafterError,
)
from .hookspecs import hookimpl
from .sampling import SamplingParams, TokenCounts, logits_to_probs
from .settings import GenerationSettings
from .types import Draft, DraftContext, GenerationResult, GenerationStats, TargetInfo, TokenLogprob

try:
    __version__ = _metadata.version("specdraft")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "ConfigError", "Draft", "DraftContext", "Drafter", "DrafterError", "GenerationResult", "GenerationSettings",
    "GenerationStats", "ModelLoadError", "PluginError", "SamplingParams", "SpecdraftError",
    "SpeculativeDecoder", "TargetInfo", "TokenCounts", "TokenLogprob", "UnknownDrafterError", "hookimpl",
    "logits_to_probs",
]
