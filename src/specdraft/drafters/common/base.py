"""The drafter interface (propose tokens, then hear back how many were accepted), the options
learnt drafters share, and the helpers of chain drafting (rows, per-sequence cache slots, chains)."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...types import Draft, DraftContext, TargetInfo
from .tree import TreeOptions


#: Learnt drafters' default ``min_confidence`` (see :class:`DraftChain`).
MIN_CONFIDENCE = 0.2


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LearntDrafterOptions(BaseModel):
    """The options every learnt drafter (draft model, heads) shares."""

    model_config = ConfigDict(extra="forbid")
    copy_gate: bool = Field(True, description="use the drafter's copy gate, if it has one (a learnt mixture of its "
                                              "guess and the token that followed the last occurrence of the "
                                              "trailing n-gram); false: its own distribution only")
    min_confidence: float = Field(MIN_CONFIDENCE, ge=0.0, le=1.0,
                                  description="greedy drafting stops at the first token the drafter gives less than "
                                              "this probability (0: always draft as many as the verifier asks for)")


class HeadOptions(LearntDrafterOptions):
    """The options of the head drafters (``medusa``, ``eagle``, ``mlp-speculator``); here, away from
    their torch-importing module, so the registry lists and checks them without importing torch."""

    heads: str | None = Field(None, description="folder with heads in specdraft's format (from `specdraft "
                                                "train-heads`) or a published layout (Medusa; EAGLE-1/2 and "
                                                "HASS; EAGLE-3 as the EAGLE repository, SGLang and ModelOpt save "
                                                "it; the speculators format's EAGLE-3 and EAGLE), or a Hugging "
                                                "Face hub id of one (the cache alone when offline); default: the "
                                                "heads shipped for the target, if any. See docs/published-heads.md")
    quantize: Literal["auto", "none", "q8_0"] = Field(
        "auto", description="the heads' products (their layers and the LM head rows they read): q8_0 multiplies "
                            "8-bit blocks (llama.cpp's Q8_0: half the bytes of bfloat16) on specdraft's CPU "
                            "operators, none keeps the weights as loaded; auto: q8_0 on a CPU where those run "
                            "(float32, bfloat16), none elsewhere. Drafts change a little, the output never: "
                            "the verifier accepts by the drafter's own distribution")


class TreeHeadOptions(HeadOptions, TreeOptions):
    """The head options plus ``tree_budget`` and ``tree_width``: the heads that draft trees
    (``eagle``: EAGLE-2's dynamic tree; ``medusa``: top-k per head)."""


class Drafter(ABC):
    """Base class of every drafter, built-in or third-party (import it from
    :mod:`specdraft.drafters.api`, or as ``specdraft.Drafter``).

    Lifecycle, driven by the engine (API version 2, the default):

    1. ``__init__(options, target)`` once, with the drafter's own validated ``Options``
       and a :class:`~specdraft.TargetInfo` describing the target model; it ends by
       calling ``reset()``. A drafter that runs a model of its own borrows a runner or a model
       loader from ``target.services`` (see :class:`~specdraft.TargetInfo`).
    2. ``on_join(seq_id, prompt)`` when a sequence joins the running batch (any step), and
       ``on_leave(seq_id)`` when it leaves (finished, aborted or failed): keep per-sequence
       state in a dict keyed by ``seq_id`` and drop it there.
    3. each round: ``propose(ctx, k)`` returns up to ``k`` tokens per row for the running
       sequences (row ``b`` is sequence ``ctx.seq_ids[b]``; rows change order between rounds),
       the target verifies them, then ``on_verified(ctx, num_accepted)`` reports how many of
       each row's tokens were accepted (``ctx.token_ids`` already includes them, plus the
       target's correction or bonus token).

    ``ctx.token_ids[b]`` always holds the full, authoritative sequence, so a stateless drafter
    (prompt lookup) needs none of the hooks.

    API version 1 (declare ``api_version = 1``; for drafters written before continuous batching,
    when 1 was the default): state keyed by row index, forgotten at ``reset()``. The engine runs
    such a drafter exactly, but in waves: a wave of sequences starts together after a
    ``reset()``, rows keep their index until the whole wave has finished (finished rows stay
    with ``active[b] = False``), and nothing joins meanwhile. A drafter that does not subclass
    this class and has no ``api_version`` attribute is run as version 1 too.
    """

    #: 2 (the default): per-sequence state (``ctx.seq_ids``); 1: per-row state, run in waves (see above)
    api_version: ClassVar[int] = 2

    #: Options this drafter accepts (pydantic, ``extra="forbid"`` so typos fail loudly).
    Options: ClassVar[type[BaseModel]] = NoOptions

    #: True for a drafter that never proposes anything (``none``): the engine then makes plain steps
    #: without asking it, nor planning a draft length (each ask and its empty proposal cost about
    #: 2% of a one-token step of the default model on a 2-core CPU). Its other hooks still run.
    never_drafts: ClassVar[bool] = False

    #: Drafters that set this get the target's last-layer hidden states (see
    #: ``on_hidden_states``); the verifier collects them only for such drafters.
    needs_hidden_states: ClassVar[bool] = False

    #: With ``needs_hidden_states``: the target layers whose states the drafter gets instead of
    #: the last layer's (the residual stream entering each block, transformers'
    #: ``output_hidden_states[i]``), concatenated in this order, from the same passes (EAGLE-3
    #: sets its three here). None: the final-norm states. May be set per instance in ``__init__``.
    hidden_layers: tuple[int, ...] | None = None

    #: Set by the registry: the name the drafter was created under, and its plugin.
    name: str = ""

    @property
    def tree_budget(self) -> int:
        """The most nodes this drafter proposes per round (its ``tree_budget`` option, if it has
        one; 1: chains only). Above 1 the engine sets ``ctx.tree_budget`` each round, up to this."""
        return int(getattr(getattr(self, "options", None), "tree_budget", 1) or 1)
    plugin: str = ""

    def __init__(self, options: BaseModel, target: TargetInfo) -> None:
        self.options = options
        self.target = target
        self.reset()

    @abstractmethod
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        """Return a :class:`~specdraft.Draft` of at most ``k`` tokens per row (``k >= 1``)."""

    def on_verified(self, ctx: DraftContext, num_accepted: list[int]) -> None:  # noqa: B027
        """Called after every verify pass; ``num_accepted[b]`` drafts of row ``b`` were kept."""

    def on_hidden_states(self, ctx: DraftContext, hidden_states: list) -> None:  # noqa: B027
        """Only for drafters with ``needs_hidden_states = True``: the target's new hidden states.

        ``hidden_states[b]  # [n_b, hidden_size]`` are the target's last-layer hidden states
        (after its final norm: what its LM head reads) at the next ``n_b`` positions of row
        ``b`` (``[n_b, len(hidden_layers) * hidden_size]``, the chosen layers' states side by
        side, for a drafter that sets :attr:`hidden_layers`). Called after the prompts' prefill of the sequences that joined this step (the
        prompt's positions but the last; other rows get ``n_b = 0``) and after every verify
        pass, before ``on_verified`` (the positions of the tokens that round committed). At every ``propose`` the drafter has therefore seen the states of
        positions ``0 .. len(ctx.token_ids[b]) - 2``: all but the last token, whose state
        the target has not computed yet (its logits would be the next token's).
        """

    def on_join(self, seq_id: int, prompt: list[int]) -> None:  # noqa: B027
        """API version 2: sequence ``seq_id`` with token ids ``prompt`` joins the running batch."""

    def on_leave(self, seq_id: int) -> None:  # noqa: B027
        """API version 2: sequence ``seq_id`` has left the batch; forget its state."""

    def reset(self) -> None:  # noqa: B027
        """Forget all state (at construction; for API version 1, before every wave of sequences)."""


def row_ids(ctx: DraftContext) -> list[int]:
    """Each row's sequence id (row indices for a context built by hand, without ids)."""
    return list(ctx.seq_ids) if ctx.seq_ids else list(range(ctx.batch_size))


def generators(ctx: DraftContext):
    """Each row's own generator (``ctx.generators``), or the round's one for a context built by hand."""
    return list(ctx.generators) if ctx.generators else ctx.generator


class SequenceSlots:
    """Rows of a drafter's own runner cache, one per sequence while it runs (reused after it leaves).

    >>> slots = SequenceSlots()
    >>> slots.join(7), slots.join(9), slots.leave(7), slots.join(4), slots.of([4, 9])
    (0, 1, None, 0, [0, 1])
    """

    def __init__(self) -> None:
        self.slot: dict[int, int] = {}
        self.free: list[int] = []  # a heap: the lowest free row first
        self.size = 0  # rows ever used: the runner needs this many

    @property
    def rows(self) -> int:
        """Rows for a cache to hold every slot: :attr:`size` rounded up to a power of two, so a cache
        reserved with it grows by doubling (one row more a join copied the whole cache at every join).

        >>> slots = SequenceSlots()
        >>> [slots.join(seq_id) * 0 + slots.rows for seq_id in range(5)]
        [1, 2, 4, 4, 8]
        """
        return 1 << max(self.size - 1, 0).bit_length()

    def join(self, seq_id: int) -> int:
        if seq_id in self.slot:
            return self.slot[seq_id]
        if self.free:
            s = heapq.heappop(self.free)
        else:
            s, self.size = self.size, self.size + 1
        self.slot[seq_id] = s
        return s

    def leave(self, seq_id: int) -> None:
        s = self.slot.pop(seq_id, None)
        if s is not None:
            heapq.heappush(self.free, s)

    def of(self, seq_ids) -> list[int]:
        return [self.slot[i] for i in seq_ids]


class DraftChain:
    """A round's chain of drafted tokens, and where greedy drafting stops for each row.

    Learnt drafters know how sure they are of each guess. Greedy drafting stops a row at the
    first token its drafter gives less than ``min_confidence`` (that token is not proposed):
    a guess the drafter itself doubts is more often a wider verify pass for nothing. The
    verifier's length policy then learns acceptance of the drafts that are made, so it drafts
    more often and longer where the drafter is sure. Sampling is not stopped this way (the
    chance that a sampled token survives is not its probability under the draft).

    ``add`` returns whether any row still drafts, so the drafter can stop its loop early.
    """

    def __init__(self, batch: int, device, min_confidence: float = 0.0, greedy: bool = True) -> None:
        import torch

        self.tokens: list = []  # [batch] tensors, one per position (rows past their length included)
        self.probs: list = []
        self.threshold = min_confidence if greedy else 0.0
        #: whether ``add`` reads a confidence (drafters skip computing one otherwise)
        self.scored = self.threshold > 0
        self.alive = torch.ones(batch, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)

    def add(self, token, probs=None, confidence=None) -> bool:
        """Append one position: ``token # [batch]``, its ``probs # [batch, vocab]`` (sampling) and
        the drafter's probability of it ``confidence # [batch]`` (greedy)."""
        self.tokens.append(token)
        if probs is not None:
            self.probs.append(probs)
        if not self.scored:  # no row stops: skip the device sync of reading ``alive``
            self.lengths += 1
            return True
        if confidence is not None:
            self.alive &= confidence.to(self.alive.device) >= self.threshold
        self.lengths += self.alive
        return self._any_alive_on_cpu()

    def _any_alive_on_cpu(self) -> bool:
        """Whether any row still drafts, where that is free to know (a CPU); on a GPU drafting goes
        on to ``k`` (the stopped rows' lengths stay where they stopped: the same draft) instead of
        a copy from the device at every position."""
        return bool(self.alive.any()) if self.alive.device.type == "cpu" else True

    def draft(self, limit=None) -> Draft:
        """The proposal (``limit # [batch]``: rows' own caps, e.g. 0 for a row the drafter cannot serve)."""
        import torch

        lengths = self.lengths if limit is None else torch.minimum(self.lengths, limit.to(self.lengths.device))
        if not self.tokens:
            return Draft.empty(len(lengths), lengths.device)
        return Draft(token_ids=torch.stack(self.tokens, 1), probs=torch.stack(self.probs, 1) if self.probs else None,
                     lengths=lengths)


#: ``SPECDRAFT_WHOLE_CHAIN=0``: no chain is drafted whole unless a drafter chooses it (to measure the loop)
WHOLE_CHAIN_ENV = "SPECDRAFT_WHOLE_CHAIN"


def drafts_whole(choice: bool | None, runner, ctx: DraftContext) -> bool:
    """Whether a drafter drafts this round's greedy chain whole (:func:`chain_whole`): its ``choice``
    (None: where ``runner`` has CUDA graphs and :data:`WHOLE_CHAIN_ENV` is not ``0``), and greedy
    rows without penalties: what a graph can hold, the choice and the confidence that stops a row."""
    import os

    if choice is None:
        whole = getattr(runner, "cuda_graphs", False) and os.environ.get(WHOLE_CHAIN_ENV, "") != "0"
    else:
        whole = choice
    return bool(whole) and hasattr(runner, "loop") and ctx.sampling.greedy and not ctx.sampling.penalized


def chain_whole(runner, state, k: int, threshold: float, logits_of, next_state, slots: list[int], key=(),
                draw=None, extras: tuple = ()):
    """A greedy chain of ``k`` tokens per row as one device function: ``runner.loop`` runs it, as one
    CUDA graph per round on a GPU, with no host work between tokens.

    ``state # [batch, ...]`` (or a tuple of such tensors): the drafter's state after its first
    pass; ``logits_of(state)`` gives
    the next token's logits ``[batch, vocab]`` and ``next_state(state, tokens # [batch], step)`` the
    state after them (``step``: the runner's one-position pass). Rows stop as :class:`DraftChain`
    stops them (at the first token below ``threshold``: the length stays), but every row drafts
    ``k`` tokens, one pass after each but the last. ``draw(state, drafted, *extras)``: the choice
    ``(tokens # [batch], confidence # [batch])`` instead of the argmax of ``logits_of(state)`` (a
    copy gate's), ``drafted`` the chain's tokens so far (``[batch]`` tensors) and ``extras`` the
    tensors it reads, copied into the graph like the state (their shapes are part of the graph's
    key: pad them to a few sizes). Returns ``(tokens # [batch, k], lengths # [batch])``.
    """
    import torch

    from ...sampling import SamplingParams

    greedy = SamplingParams()

    tupled = isinstance(state, tuple)
    states = state if tupled else (state,)  # the graph's inputs: tensors

    def chain_of(*inputs):
        *read, step = inputs[len(states):]
        state = inputs[:len(states)] if tupled else inputs[0]
        chain = DraftChain(inputs[0].shape[0], inputs[0].device, threshold)
        for i in range(k):
            if draw is None:
                token, _, confidence = draw_scored(logits_of(state), greedy, None, chain.scored)
            else:
                token, confidence = draw(state, chain.tokens, *read)
            chain.add(token, None, confidence)
            if i + 1 < k:
                state = next_state(state, token, step)
        return torch.stack(chain.tokens, 1), chain.lengths

    shapes = tuple(tuple(t.shape) for t in extras)
    return runner.loop(chain_of, (*states, *extras), k - 1, slots, key=(key, shapes))


def draw_scored(logits, sampling, generator=None, scored: bool = False, counts=None):
    """:func:`~specdraft.sampling.draw` on ``logits # [batch, vocab]`` with the penalties' context
    ``counts`` (see :meth:`DraftContext.counts_after`) plus, when greedy and ``scored`` (see
    :attr:`DraftChain.scored`), the probability of the drawn token ``# [batch]``:
    ``(tokens, probs | None, confidence | None)``."""
    from ...sampling import draw, penalize

    token, probs = draw(logits, sampling, generator, counts)
    confidence = penalize(logits, sampling, counts).softmax(-1).amax(-1) if scored and sampling.greedy else None
    return token, probs, confidence
