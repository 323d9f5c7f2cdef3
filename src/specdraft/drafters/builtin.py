"""The built-in drafters, registered through the same hook as any third-party plugin.

The head drafters import torch (and transformers) at module level, so they are registered
by import path with their options: listing drafters and checking options stays fast, and
their module loads when one is created.

This is the one module under ``drafters/`` that imports drafters' modules (to register them);
the drafters themselves import only :mod:`specdraft.drafters.api` and ``drafters/common/``.
"""

from __future__ import annotations

from .api import hookimpl


@hookimpl
def register_drafters(register):
    from .api import HeadOptions, TreeHeadOptions
    from .draft_model import LLAMA_1B, DraftModelDrafter
    from .ngram import NGramDrafter
    from .none import NoDrafter
    from .prompt_lookup import PromptLookupDrafter
    from .suffix import SuffixDrafter

    register("ngram", NGramDrafter)
    register("prompt-lookup", PromptLookupDrafter, aliases=("pld",))
    register("suffix", SuffixDrafter)  # SuffixDecoding: frequent-continuation trees from suffix tries
    register("none", NoDrafter, aliases=("plain",))
    register("draft-model", DraftModelDrafter)
    register("llama-1b", DraftModelDrafter, defaults={"model": LLAMA_1B})
    register("medusa", "specdraft.drafters.heads:MedusaDrafter", options=TreeHeadOptions)
    register("eagle", "specdraft.drafters.heads:EagleDrafter", options=TreeHeadOptions)
    register("eagle3", "specdraft.drafters.heads:Eagle3Drafter", options=TreeHeadOptions)
    register("mlp-speculator", "specdraft.drafters.heads:MLPSpeculatorDrafter", options=HeadOptions)
