"""Where plugins found the tree helpers before :mod:`specdraft.drafters.api` (kept so that they keep
working; new code imports them from the API). The code is in ``drafters/common/tree.py``."""

from .api import MAX_TREE_BUDGET, TreeOptions, tree_draft, trie

__all__ = ["MAX_TREE_BUDGET", "TreeOptions", "tree_draft", "trie"]
