"""The verifier core: drafts in, one batched K+1 target pass, exact acceptance, an Outcome out.

- :mod:`.proposal` -- a drafter's :class:`~specdraft.Draft`, validated once, becomes a
  :class:`Proposal`: a chain, or a tree with its :class:`TreeShape` (decided here, nowhere else);
- :mod:`.core` -- :class:`Verifier`: the pass ``[last, d_1..d_k]`` over the target's runner (a
  tree mask and depths for a tree), acceptance, and the round's :class:`Outcome`;
- :mod:`.chain`, :mod:`.tree` -- acceptance as pure float32 tensor functions: greedy and
  rejection sampling (Leviathan et al. 2023; Chen et al. 2023), multi-draft sampling down a
  tree (SpecInfer, Miao et al. 2024).

It needs no engine: give it a runner (anything with ``forward``, ``cache`` and
``supports_tree``) and it verifies whatever each row proposes.
"""

from .chain import greedy_accept, rejection_sample
from .core import Outcome, Verifier, accept
from .proposal import Proposal, TreeShape, check_draft, empty_proposal, make_proposal
from .tree import first_chain, greedy_tree_accept, tree_ancestors, tree_rejection_sample

__all__ = ["Outcome", "Proposal", "TreeShape", "Verifier", "accept", "check_draft", "empty_proposal", "first_chain",
           "greedy_accept", "greedy_tree_accept", "make_proposal", "rejection_sample", "tree_ancestors",
           "tree_rejection_sample"]
