"""specdraft: exact speculative decoding with pluggable drafters."""

from .decoder import SpeculativeDecoder
from .drafters.base import Drafter
from .errors import (
    ConfigError,
    DrafterError,
    ModelLoadError,
    PluginError,
    SpecdraftError,
    UnknownDrafterError,
)
from .hookspecs import hookimpl
from .sampling import SamplingParams, logits_to_probs
from .types import Draft, DraftContext, GenerationResult, GenerationStats, TargetInfo

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "Draft", "DraftContext", "Drafter", "DrafterError", "GenerationResult",
    "GenerationStats", "ModelLoadError", "PluginError", "SamplingParams", "SpecdraftError",
    "SpeculativeDecoder", "TargetInfo", "UnknownDrafterError", "hookimpl", "logits_to_probs",
]
