"""Dataclasses shared by the verifier, the drafters and the public API.

Nothing here imports torch at module level, so listing plugins stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .sampling import RowSampling, SamplingParams, TokenCounts


def default_services():
    """The services a :class:`TargetInfo` lends drafters when it is given none: specdraft's own
    runners and model loading (a :class:`~specdraft.services.DrafterServices`, which imports them
    only when a method is called)."""
    from .services import DrafterServices

    return DrafterServices()


class TargetRunner(Protocol):
    """What the engine and the verifier use of a target's runner (``specdraft.runner``'s
    :class:`~specdraft.runner.ModelRunner`, the transformers fallback, the tensor-parallel one):
    its KV cache, its one forward pass, how it describes itself, and its lifetime."""

    #: the KV cache the passes run over (:mod:`specdraft.cache`'s interface)
    cache: Any
    #: whether :meth:`forward` takes a tree (``tree_mask``, ``depths``)
    supports_tree: bool

    def forward(self, tokens, logits_at=None, hidden=False, advance=None, slots=None, tree_mask=None,
                depths=None) -> tuple:
        """``(logits, hidden)`` of ``tokens # [rows, W]`` after each row's stored tokens (see
        :meth:`specdraft.runner.ModelRunner.forward`)."""

    def warm_up(self, rows: int, widths) -> None:
        """Compile (or capture) the passes of ``widths`` for ``rows`` rows now; free when eager."""

    @property
    def info(self) -> dict:
        """``{"implementation", "compiled", "quantization", "dtype"}``."""

    def close(self) -> None:
        """Release what the runner holds beyond itself (a sharded runner's other ranks)."""


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may know about the target model, handed over once at construction.

    Deliberately small: drafters that need more (a second model, heads) load it themselves
    from their own options, and check it against this description. What they need of
    specdraft's machinery to do so (a runner for a draft model or for decoder layers, model
    loading) they borrow from ``services`` instead of importing it.
    """

    vocab_size: int  # rows of the target's logits (may exceed len(tokenizer))
    device: Any  # torch.device the target runs on
    dtype: Any  # torch.dtype of the target's weights
    max_context: int  # positions the target supports
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: Any = None  # a transformers tokenizer, or None for id-only use
    config: Any = None  # the target's transformers config, or None
    name: str = ""  # what the user asked for (hub id, path, or the default's name)
    #: the target's input embedding module, read-only: drafts and heads may share it
    embeddings: Any = None
    #: the target's output head (hidden state -> logits), read-only: heads may share it
    lm_head: Any = None
    #: width of the target's last-layer hidden states (what ``on_hidden_states`` hands over)
    hidden_size: int = 0
    #: what a drafter that runs a model of its own borrows (see :mod:`specdraft.services`):
    #: ``model_runner(model, compile=None)``, ``layer_runner(hf_layers, config, compile=None,
    #: attention_norm=True, quantize=None)``, ``fast_linears(module, skip, quantize=None)``,
    #: ``fast_linear(weight, bias, quantize=None)``, ``drafting_quantize(quantize, device, dtype)``,
    #: ``attention_backends(device)``, ``load_model(source, dtype, device)``,
    #: ``resolve_device(device)``, ``resolve_dtype(dtype, device)``; a TargetInfo built by hand gets
    #: specdraft's own, a test may pass any object with the methods it needs
    services: Any = field(default_factory=default_services, compare=False, repr=False)


@dataclass
class DraftContext:
    """Everything a drafter sees in one round.

    Row ``b`` is the sequence ``seq_ids[b]``: ``token_ids[b]`` is its prompt + accepted output,
    and the drafter proposes what comes after its last token. Rows are the sequences running
    this round, in an order that changes as sequences join and leave: keep per-sequence state
    by ``seq_ids[b]`` (see :class:`~specdraft.Drafter`). Rows whose ``active[b]`` is False have
    finished (only drafters of API version 1 see such rows); a drafter may skip them.
    """

    token_ids: list[list[int]]  # [batch][seq_len_b]
    prompt_lengths: list[int]  # [batch]
    active: list[bool]  # [batch]
    vocab_size: int
    device: Any
    #: each row's sampling settings (a :class:`~specdraft.sampling.RowSampling`, which every
    #: function of ``specdraft.sampling`` takes; ``.greedy`` is True when every row is greedy)
    sampling: "RowSampling | SamplingParams"
    #: one generator for the whole round (drafters that draw batch-wide tensors)
    generator: "torch.Generator | None" = None
    #: each row's own generator, reseeded every round from its seed and length: draw row ``b``'s
    #: tokens from ``generators[b]`` (``specdraft.sampling.draw`` takes the list) and a seeded
    #: request's output does not depend on what else shares its batch
    generators: list = field(default_factory=list)
    #: each row's sequence id, stable while the sequence runs  # [batch]
    seq_ids: list[int] = field(default_factory=list)
    #: set before ``on_verified``: how many of each row's proposed tokens were verified (the
    #: verifier may trim a draft to its adaptive length or to what is left of the budget)
    num_verified: list[int] = field(default_factory=list)
    #: what the sampling penalties read of ``token_ids`` (set before ``propose`` when a penalty
    #: is on, else None); use :meth:`counts_after` at each drafted position
    counts: "TokenCounts | None" = None
    #: nodes a tree-drafting drafter may propose this round (1: a chain), chosen by the engine's
    #: policy up to the drafter's own ``tree_budget`` attribute; chain drafters ignore it
    tree_budget: int = 1
    #: set before ``on_verified``: each row's accepted nodes, root's child first (a chain's are
    #: ``0..n-1``; a tree's say which branch was taken)
    accepted_nodes: list = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.token_ids)

    def counts_after(self, drafted: "Sequence[torch.Tensor] | torch.Tensor" = ()) -> "TokenCounts | None":
        """The penalties' context at the next drafted position, after the tokens ``drafted`` this
        round (a list of ``[batch]`` tensors, or ``[batch, n]``); pass it to
        :func:`~specdraft.sampling.logits_to_probs`. None when no penalty is on."""
        if self.counts is None:
            return None
        import torch

        if isinstance(drafted, torch.Tensor):
            return self.counts.plus(drafted)
        return self.counts.plus(torch.stack(list(drafted), 1)) if len(drafted) else self.counts


@dataclass
class Draft:
    """A drafter's proposal for one round.

    ``token_ids``  LongTensor  # [batch, k']   0 <= k' <= k
    ``probs``      FloatTensor # [batch, k', vocab] the distribution each token was drawn
                               # from, after the same sampling pipeline as the target, with
                               # that position's context (``specdraft.logits_to_probs(logits,
                               # ctx.sampling, ctx.counts_after(drafted))``), or None for a
                               # deterministic draft (treated as one-hot). Any dtype: the
                               # verifier compares them in float32 or wider.
    ``lengths``    LongTensor  # [batch] how many of the k' columns are real for each row;
                               # None means all k'. Columns past a row's length are ignored.
    ``parents``    LongTensor  # [batch, n] optional: a tree of n nodes instead of a chain.
                               # parents[b, i] is node i's parent (-1: the last committed
                               # token), always < i; a node's depth (1 + its parent's) is at
                               # most k, while n may exceed k. probs[b, i] is the distribution
                               # node i's token was drawn from given its ancestors (siblings
                               # drawn independently from one distribution share it, and may
                               # repeat a token); None: every node deterministic (one-hot).
                               # A chain is parents = [-1, 0, 1, ...]. Nodes past a row's
                               # length are ignored; so is a node whose parent is.
    """

    token_ids: "torch.Tensor"
    probs: "torch.Tensor | None" = None
    lengths: "torch.Tensor | None" = None
    parents: "torch.Tensor | None" = None

    @classmethod
    def from_tree_lists(cls, rows: Sequence[Sequence[tuple[int, int]]], device: Any = None) -> "Draft":
        """A deterministic tree from one list of ``(parent, token)`` nodes per row, parents
        before their children (parent -1: the last committed token); ragged is fine.

        >>> Draft.from_tree_lists([[(-1, 5), (-1, 7), (0, 9)]]).parents.tolist()
        [[-1, -1, 0]]
        """
        import torch

        draft = cls.from_lists([[t for _, t in row] for row in rows], device=device)
        parents = torch.full(draft.token_ids.shape, -1, dtype=torch.long)
        for b, row in enumerate(rows):
            if row:
                parents[b, : len(row)] = torch.as_tensor([p for p, _ in row], dtype=torch.long)
        draft.parents = parents.to(draft.token_ids.device)
        return draft

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]], device: Any = None) -> "Draft":
        """Build a deterministic draft from one list of token ids per row (ragged is fine)."""
        import torch

        width = max((len(r) for r in rows), default=0)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            if row:
                ids[b, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        if device is not None:
            ids, lengths = ids.to(device), lengths.to(device)
        return cls(token_ids=ids, lengths=lengths)

    @classmethod
    def empty(cls, batch_size: int, device: Any = None) -> "Draft":
        return cls.from_lists([[] for _ in range(batch_size)], device=device)


@dataclass
class GenerationStats:
    """Per-request speculation metrics.

    Times are the sequence's own: ``total_time_s`` from submission to its last token, drafting and
    verifying the steps it took part in (shared with its batchmates), prefill its own.
    """

    prompt_tokens: int = 0
    #: prompt tokens read from the prefix cache instead of prefilled (OpenAI's ``cached_tokens``)
    cached_tokens: int = 0
    new_tokens: int = 0
    drafts: int = 0  # rounds that drafted at least one token
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_passes: int = 0  # verify passes (the prompt's prefill is not counted)
    #: of the drafts made from the request's prediction (OpenAI's ``completion_tokens_details``):
    #: predicted tokens verified and kept, and verified and refused
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [k] rounds whose draft reached depth i
    accepted_per_position: list[int] = field(default_factory=list)  # [k] rounds that accepted depth i
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens emitted per target pass, bonus/correction token included."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft position i accepted | position i drafted), for i = 0..k-1."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    @property
    def nodes_per_draft(self) -> float:
        """Draft tokens (a tree's nodes) verified per round that drafted."""
        return self.drafted_tokens / self.drafts if self.drafts else 0.0

    @property
    def accepted_per_draft(self) -> float:
        """Accepted draft tokens per round that drafted (a tree's accepted path length)."""
        return self.accepted_tokens / self.drafts if self.drafts else 0.0

    def record_round(self, num_drafted: int, num_accepted: int, depth: int | None = None) -> None:
        """Count one verify pass in which ``num_drafted`` tokens (a tree's nodes, ``depth`` levels
        deep; a chain's depth is its length) were checked and ``num_accepted`` kept."""
        depth = num_drafted if depth is None else depth
        self.target_passes += 1
        self.drafts += num_drafted > 0
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        if len(self.drafted_per_position) < depth:
            grow = depth - len(self.drafted_per_position)
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(depth):
            self.drafted_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1


#: The most choices (``n``) one request may ask for: OpenAI's limit.
MAX_CHOICES = 128

#: the most top tokens a request may ask for at each output position (``logprobs=N``; vLLM's default
#: limit and OpenAI's chat limit)
MAX_LOGPROBS = 20
#: what ``logprobs_mode`` may be (vLLM's ``--logprobs-mode`` names, less its logits variants)
LOGPROBS_MODES = ("processed", "raw")


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one output token, and the most likely tokens at its
    position (asked for with ``logprobs=N``): from the distribution the token was drawn from
    (``logprobs_mode="processed"``: after the penalties, temperature and filters, -inf for a
    filtered token; greedy rows: the penalized logits without temperature) or from the model's
    own logits (``"raw"``); the same numbers plain decoding reports at that position."""

    token_id: int
    logprob: float
    #: the ``N`` most likely tokens there, ``(token id, logprob)``, most likely first (ties: lower id first)
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    """One request's output. ``token_ids`` are the new tokens only (EOS included if hit)."""

    token_ids: list[int]
    text: str | None
    #: "eos" | "length" (max_new_tokens or the model's context) | "stop" | "interrupted" (Ctrl-C)
    #: | "aborted" (the caller closed its stream)
    finish_reason: str
    stats: GenerationStats
    #: one entry per token of ``token_ids`` when the call asked for ``logprobs``, else None
    logprobs: list[TokenLogprob] | None = None


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """The model's end-of-sequence token ids (its generation config's, its config's, its tokenizer's)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def describe_target(model, tokenizer=None, target_name: str = "") -> TargetInfo:
    """What drafters are told about a loaded target model."""
    config = model.config.get_text_config()
    return TargetInfo(
        vocab_size=model.get_output_embeddings().weight.shape[0],
        device=model.device,
        dtype=model.dtype,
        max_context=int(getattr(config, "max_position_embeddings", 0) or 2**31 - 1),
        eos_token_ids=eos_ids(model, tokenizer),
        tokenizer=tokenizer,
        config=config,
        name=target_name or getattr(config, "_name_or_path", ""),
        embeddings=model.get_input_embeddings(),
        lm_head=model.get_output_embeddings(),
        hidden_size=int(getattr(config, "hidden_size", 0) or 0),
    )


