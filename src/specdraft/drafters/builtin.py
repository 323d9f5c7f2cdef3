"""The built-in drafters, registered through the same hook as any third-party plugin."""

from __future__ import annotations

from ..hookspecs import hookimpl


@hookimpl
def register_drafters(register):
    from .draft_model import LLAMA_1B, DraftModelDrafter
    from .heads import EagleDrafter, MedusaDrafter, MLPSpeculatorDrafter
    from .ngram import NGramDrafter
    from .none import NoDrafter
    from .prompt_lookup import PromptLookupDrafter

    register("ngram", NGramDrafter)
    register("prompt-lookup", PromptLookupDrafter, aliases=("pld",))
    register("none", NoDrafter, aliases=("plain",))
    register("draft-model", DraftModelDrafter)
    register("llama-1b", DraftModelDrafter, defaults={"model": LLAMA_1B})
    register("medusa", MedusaDrafter)
    register("eagle", EagleDrafter)
    register("mlp-speculator", MLPSpeculatorDrafter)
