"""Where plugins found EAGLE-2's dynamic tree before :mod:`specdraft.drafters.api` (kept so that they
keep working; new code imports it from the API). The code is in ``drafters/common/dynamic_tree.py``."""

from .api import grow_tree, node_contexts, processed_probs
from .common.dynamic_tree import Feed, NextProbs

__all__ = ["Feed", "NextProbs", "grow_tree", "node_contexts", "processed_probs"]
