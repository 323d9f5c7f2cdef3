"""Where plugins found the drafter base class and its helpers before :mod:`specdraft.drafters.api`.

Kept so that a plugin written against the documented paths (``specdraft.drafters.base.SequenceSlots``,
``row_ids``, ``generators``, ``model_runner``, ``layer_runner``) keeps working. New code imports
:mod:`specdraft.drafters.api`, and asks ``self.target.services`` for runners.
"""

from __future__ import annotations

from .api import (MIN_CONFIDENCE, DraftChain, Drafter, HeadOptions, LearntDrafterOptions, NoOptions, SequenceSlots,
                  TreeHeadOptions, default_services, draw_scored, generators, row_ids)


def model_runner(model, compile: bool | None = None):
    """``self.target.services.model_runner(model, compile)``, with specdraft's own services."""
    return default_services().model_runner(model, compile)


def layer_runner(hf_layers, config, compile: bool | None = None, attention_norm: bool = True):
    """``self.target.services.layer_runner(...)``, with specdraft's own services."""
    return default_services().layer_runner(hf_layers, config, compile=compile, attention_norm=attention_norm)


def attention_backends(device):
    """``self.target.services.attention_backends(device)``, with specdraft's own services."""
    return default_services().attention_backends(device)


__all__ = ["MIN_CONFIDENCE", "DraftChain", "Drafter", "HeadOptions", "LearntDrafterOptions", "NoOptions",
           "SequenceSlots", "TreeHeadOptions", "attention_backends", "draw_scored", "generators", "layer_runner",
           "model_runner", "row_ids"]
