"""The verifier core: a drafter's draft in, one batched target pass, exact acceptance, one :class:`Outcome` out.

    verifier = Verifier(runner, vocab_size, device, who="'ngram'")
    proposal = verifier.proposal(draft, caps)                # validated; a chain or a tree, decided here
    logits, hidden = verifier.verify(proposal, last, slots, longest)   # [last, d_1..d_k] in one pass
    outcome = verifier.accept(proposal, logits, sampling, generators, counts, hidden)
    outcome = verifier.verify_greedy(proposal, last, slots, longest)   # greedy chains: both at once

``verify_greedy`` is a greedy round whose logits nothing else reads (no penalty, bias, grammar,
``min_tokens`` hold or logprobs): its acceptance runs inside the pass (``runner.forward(then=)``),
in the pass's CUDA graph on a GPU, so nothing is launched between the graph and the round's copy.

Acceptance keeps the target's output law exactly: greedy rows take the longest prefix (a tree: the
path) the target's argmax agrees with; sampled rows run rejection sampling, each with its own
settings and generator, over its own drafted positions only, so its random draws do not depend
on what else shares the pass. Arithmetic in float32 or wider (:mod:`.chain`, :mod:`.tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import RowSampling, TokenCounts, argmax, greedy_tokens, logits_to_probs
from ..types import TargetRunner
from .chain import greedy_accept, rejection_sample
from .proposal import DEBUG, Proposal, empty_proposal, make_proposal
from .tree import greedy_tree_accept, tree_rejection_sample


@dataclass
class Outcome:
    """What a round kept, per row, on the host (the round's one device-to-host copy)."""

    num_accepted: list[int]  # [batch] draft tokens (a tree's path nodes) accepted
    next_token: list[int]  # [batch] the recovered or bonus token after them
    paths: list[list[int]]  # [batch][num_accepted] accepted nodes, root's child first (a chain's 0..n-1)
    tokens: list[list[int]]  # [batch][num_accepted] the accepted draft tokens
    drafted: list[int]  # [batch] tokens (a tree's valid nodes) verified
    depths: list[int]  # [batch] levels verified (a chain's length)
    hidden: torch.Tensor | None = None  # [batch, width + 1, dim] the pass's final-norm hidden states, if asked for

    def committed(self, b: int) -> list[int]:
        """Row ``b``'s new tokens: the accepted ones, then the next."""
        return self.tokens[b] + [self.next_token[b]]

    def branched(self, b: int) -> bool:
        """Whether row ``b`` took a tree branch off its first-drafted line (its cache entries then move)."""
        return self.paths[b] != list(range(self.num_accepted[b]))

    def pass_indices(self, b: int) -> list[int]:
        """The pass indices whose outputs gave row ``b``'s committed tokens, in order: 0 (the last
        committed token's), then ``p + 1`` for each accepted node ``p`` (a chain's: ``0..n``)."""
        return [0] + [p + 1 for p in self.paths[b]]

    def hidden_at(self, b: int, n: int) -> torch.Tensor:
        """Row ``b``'s hidden states at the first ``n`` positions it committed (the last committed
        token, then its accepted nodes): those whose next token is now known.  # [n, dim]"""
        if not self.branched(b):  # a chain's: the first n, a view (no index tensor made)
            return self.hidden[b, : min(n, self.num_accepted[b] + 1)]
        return self.hidden[b, torch.tensor(self.pass_indices(b)[:n], device=self.hidden.device)]


class Verifier:
    """Verifies drafts against the target's ``runner`` (see the module docstring). ``who`` names the
    drafter in errors; ``full_checks`` validates every draft's values, not only its shapes (a
    device-to-host copy per round: the default on CPU, where it is free, and with ``SPECDRAFT_DEBUG=1``)."""

    def __init__(self, runner: TargetRunner, vocab_size: int, device, who: str = "",
                 full_checks: bool | None = None) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.who = who
        self.full_checks = DEBUG or self.device.type == "cpu" if full_checks is None else full_checks

    @property
    def trees(self) -> bool:
        """Whether the runner verifies trees (else a tree is verified as its first chain)."""
        return bool(self.runner.supports_tree)

    def proposal(self, draft, caps: list[int], predicted: dict[int, list[int]] | None = None) -> Proposal:
        """The :class:`Proposal` of ``draft`` (None: nothing drafted) for rows capped at ``caps``;
        rows ``predicted`` draft their request's predicted tokens instead (see :mod:`.prediction`)."""
        if draft is None and not predicted:
            return empty_proposal(len(caps), self.device)
        return make_proposal(draft, caps, self.vocab_size, self.who, self.device, full=self.full_checks,
                             trees=self.trees, predicted=predicted)

    def verify(self, proposal: Proposal, last: list[int], slots: list[int], longest: int,
               hidden: bool | tuple[int, ...] = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass of ``[last[b], d_1..d_width]`` on cache rows ``slots`` (each holds at most
        ``longest`` tokens): ``(logits # [batch, width + 1, vocab], hidden # [batch, width + 1, dim] | None)``
        (``hidden=(i, j, ...)``: the states entering those layers side by side, ``n * dim`` wide)."""
        self.runner.cache.reserve(longest + proposal.width + 1)
        tokens, tree = proposal.pass_inputs(torch.tensor([[t] for t in last], device=self.device))
        return self.runner.forward(tokens, hidden=hidden, slots=slots, **tree)

    def accept(self, proposal: Proposal, logits: torch.Tensor, sampling: RowSampling, generators: list,
               counts: TokenCounts | None = None, hidden: torch.Tensor | None = None) -> Outcome:
        """Each row's accepted tokens and next token (see :class:`Outcome`). ``sampling[b]`` is row
        ``b``'s settings, ``generators[b]`` its generator (unused for greedy rows); ``counts`` the
        penalties' context of the rows (None: no penalty)."""
        num_accepted, next_token, path = accept(proposal, logits, sampling, generators, proposal.counts_along(counts))
        return self._outcome(proposal, num_accepted, next_token, path, hidden)

    def greedy_in_pass(self, proposal: Proposal) -> bool:
        """Whether :meth:`verify_greedy` can verify ``proposal`` (the caller knows its rows are
        greedy and that nothing else reads their logits): a chain, on a runner that takes ``then``."""
        return proposal.tree is None and getattr(self.runner, "passes_then", False)

    def verify_greedy(self, proposal: Proposal, last: list[int], slots: list[int], longest: int,
                      hidden: bool | tuple[int, ...] = False) -> Outcome:
        """:meth:`verify` and greedy acceptance of a chain in one call, acceptance inside the pass
        (in its CUDA graph on a GPU): the :class:`Outcome` :meth:`accept` gives for greedy rows
        whose logits nothing processes (see :meth:`greedy_in_pass`)."""
        self.runner.cache.reserve(longest + proposal.width + 1)
        tokens, _ = proposal.pass_inputs(torch.tensor([[t] for t in last], device=self.device))
        num_accepted, next_token, *states = self.runner.forward(
            tokens, hidden=hidden, slots=slots, then=(_greedy_chain, (proposal.token_ids, proposal.lengths), "greedy"))
        path = torch.arange(proposal.width, device=num_accepted.device).expand(num_accepted.shape[0], proposal.width)
        return self._outcome(proposal, num_accepted, next_token, path, states[0] if states else None)

    @staticmethod
    def _outcome(proposal: Proposal, num_accepted: torch.Tensor, next_token: torch.Tensor, path: torch.Tensor,
                 hidden: torch.Tensor | None) -> Outcome:
        """The round's :class:`Outcome`, in the round's one copy to the host."""
        width = proposal.width
        kept = proposal.token_ids.gather(1, path.clamp(max=max(width - 1, 0))) if width else path
        rows = torch.cat([num_accepted[:, None], next_token[:, None], proposal.lengths[:, None],
                          proposal.depths[:, None], path, kept], dim=1).tolist()
        return Outcome(num_accepted=[r[0] for r in rows], next_token=[r[1] for r in rows],
                       paths=[r[4 : 4 + width][: r[0]] for r in rows], tokens=[r[4 + width :][: r[0]] for r in rows],
                       drafted=[r[2] for r in rows], depths=[r[3] for r in rows], hidden=hidden)


def _greedy_chain(logits: torch.Tensor, hidden: torch.Tensor | None, token_ids: torch.Tensor,
                  lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Greedy acceptance of a chain from its pass's ``logits # [batch, width + 1, vocab]``, as
    :func:`accept` does it for greedy rows without penalties: ``(num_accepted, next_token)``, and
    ``hidden`` when the pass gave states."""
    num_accepted, next_token = greedy_accept(token_ids, lengths, argmax(logits))
    return (num_accepted, next_token) + (() if hidden is None else (hidden,))


def accept(proposal: Proposal, logits: torch.Tensor, sampling: RowSampling, generators: list,
           counts: TokenCounts | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_accepted # [batch], next_token # [batch], path # [batch, width])`` for ``logits #
    [batch, width + 1, vocab]`` of ``proposal``'s pass, ``counts`` the penalties' context at each
    pass index: greedy rows together, sampled rows' distributions together, then their draws
    (chains in one call, trees a walk per row; each row's numbers from its own generator; float32
    or wider). ``path[b]`` holds the accepted nodes first, then ``width``."""
    rule = _TREE if proposal.tree is not None else _CHAIN
    device = logits.device
    batch, width = proposal.token_ids.shape
    greedy = [b for b in range(batch) if sampling[b].greedy]
    if len(greedy) == batch:
        return rule.greedy(proposal, slice(None), greedy_tokens(logits, sampling, counts))
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.full((batch, width), width, dtype=torch.long, device=device)
    if greedy:
        pick = torch.tensor(greedy, device=device)
        wanted = greedy_tokens(logits[pick], RowSampling(sampling[b] for b in greedy),
                               None if counts is None else counts.select(pick))
        num_accepted[pick], next_token[pick], path[pick] = rule.greedy(proposal, pick, wanted)
    sampled = [b for b in range(batch) if not sampling[b].greedy]
    if sampled:  # the target's distributions of the sampled rows in one call (vectorised where they share
        # settings; each row's numbers are its own), then their draws, each row's from its own generator
        pick = torch.tensor(sampled, device=device)
        target_probs = logits_to_probs(logits[pick], RowSampling(sampling[b] for b in sampled),
                                       None if counts is None else counts.select(pick))  # [S, width + 1, vocab]
        num_accepted[pick], next_token[pick], path[pick] = rule.sample(proposal, sampled, pick, target_probs,
                                                                       [generators[b] for b in sampled])
    return num_accepted, next_token, path


class _CHAIN:
    """Acceptance of chains: :func:`greedy_accept`, :func:`rejection_sample`."""

    @staticmethod
    def greedy(p: Proposal, pick, wanted: torch.Tensor):
        n, token = greedy_accept(p.token_ids[pick], p.lengths[pick], wanted)
        return n, token, torch.arange(p.width, device=wanted.device).expand(n.shape[0], p.width)

    @staticmethod
    def sample(p: Proposal, rows: list[int], pick: torch.Tensor, target_probs: torch.Tensor, generators: list):
        """Rejection sampling of ``rows`` (``pick``: them as a tensor), in one call; ``target_probs #
        [len(rows), width + 1, vocab]``: their distributions, ``generators``: theirs. A row draws its
        cap + 1 uniforms (known on the host, a function of its own request), whatever its batchmates
        drafted."""
        draft_probs = None if p.draft_probs is None else p.draft_probs[pick]
        draws = None if p.caps is None else [p.caps[b] + 1 for b in rows]
        n, token = rejection_sample(p.token_ids[pick], p.lengths[pick], draft_probs, target_probs, generators, draws)
        return n, token, torch.arange(p.width, device=n.device).expand(n.shape[0], p.width)


class _TREE:
    """Acceptance of trees: :func:`greedy_tree_accept`, :func:`tree_rejection_sample`."""

    @staticmethod
    def greedy(p: Proposal, pick, wanted: torch.Tensor):
        return greedy_tree_accept(p.token_ids[pick], p.tree.parents[pick], p.tree.valid[pick], wanted)

    @staticmethod
    def sample(p: Proposal, rows: list[int], pick: torch.Tensor, target_probs: torch.Tensor, generators: list):
        """Tree rejection sampling of ``rows``, a walk per row; ``target_probs # [len(rows), width +
        1, vocab]``: their distributions, ``generators``: theirs."""
        n, width, device = len(rows), p.width, p.token_ids.device
        num_accepted = torch.zeros(n, dtype=torch.long)
        next_token = torch.zeros(n, dtype=torch.long)
        path = torch.full((n, width), width, dtype=torch.long)
        for i, b in enumerate(rows):
            nodes, token = tree_rejection_sample(p.token_ids[b], p.tree.parents[b], p.tree.valid[b],
                                                 None if p.draft_probs is None else p.draft_probs[b], target_probs[i],
                                                 generators[i])
            num_accepted[i], next_token[i] = len(nodes), token
            path[i, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
        return num_accepted.to(device), next_token.to(device), path.to(device)
