"""The drafter API: everything a drafter may import from specdraft, and nothing else.

A drafter, built-in or third-party, imports this module (plus torch, pydantic and the like):

    from specdraft.drafters.api import Draft, DraftContext, Drafter, hookimpl, prompt_lookup

What a drafter needs of the rest of specdraft comes with its :class:`TargetInfo`, never by
import: a drafter that runs a model of its own borrows a runner for it, a runner for a stack of
decoder layers or a model loader from ``target.services`` (``model_runner``, ``layer_runner``,
``attention_backends``, ``load_model``, ``resolve_device``, ``resolve_dtype``; see
:mod:`specdraft.services`). So the engine, the verifier, the runner, the cache and the model
loading can change shape without breaking a drafter, and ``tests/drafters/test_imports.py``
fails when a drafter module (or a package under ``plugins/``) imports any of them, or another
drafter's module.

Importing this module does not import torch.
"""

from __future__ import annotations

from ..errors import ConfigError, DrafterError, ModelLoadError
from ..files import write_atomic
from ..hookspecs import hookimpl
from ..sampling import (RowSampling, SamplingParams, TokenCounts, draw, greedy_tokens, logits_to_probs, penalize,
                        restrict, sample_rows)
from ..types import Draft, DraftContext, TargetInfo, default_services
from .common.base import (MIN_CONFIDENCE, DraftChain, Drafter, HeadOptions, LearntDrafterOptions, NoOptions,
                          SequenceSlots, TreeHeadOptions, chain_whole, drafts_whole, draw_scored, generators,
                          row_ids)
from .common.dynamic_tree import grow_tree, node_contexts, processed_probs
from .common.lookup import lookup, lookup_all, prompt_lookup
from .common.tree import MAX_TREE_BUDGET, TreeOptions, tree_draft, trie

__all__ = [
    # the interface: subclass Drafter, return a Draft, register with @hookimpl
    "Draft", "DraftContext", "Drafter", "TargetInfo", "hookimpl",
    # options bases (pydantic; extra="forbid")
    "HeadOptions", "LearntDrafterOptions", "MAX_TREE_BUDGET", "MIN_CONFIDENCE", "NoOptions", "TreeHeadOptions",
    "TreeOptions",
    # errors a drafter raises
    "ConfigError", "DrafterError", "ModelLoadError",
    # sampling: the target's pipeline, which a drafter's reported probabilities must follow
    "RowSampling", "SamplingParams", "TokenCounts", "draw", "draw_scored", "greedy_tokens", "logits_to_probs",
    "penalize", "restrict", "sample_rows",
    # rows, sequences and chains (a greedy chain whole: one CUDA graph per round)
    "DraftChain", "SequenceSlots", "chain_whole", "drafts_whole", "generators", "row_ids",
    # trees
    "grow_tree", "node_contexts", "processed_probs", "tree_draft", "trie",
    # n-gram lookup
    "lookup", "lookup_all", "prompt_lookup",
    # services (runners, model loading) for code that has no TargetInfo at hand; files
    "default_services", "write_atomic",
]
