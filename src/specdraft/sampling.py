"""Sampling settings and the logits -> probabilities pipeline shared by target and drafters.

Exactness needs the *same* processing on both sides: the verifier runs the target's logits
through :func:`logits_to_probs`, and a drafter that samples (a draft model, heads) draws its
tokens from ``logits_to_probs(its_logits, ctx.sampling, ctx.counts_after(drafted))`` and
reports those rows as ``Draft.probs``.

The pipeline, in order (transformers' order; the penalties read each position's own context):

1. ``repetition_penalty`` (transformers' semantics): for every token already in the context
   (prompt, output so far, drafts before this position), a positive logit is divided by the
   penalty and a negative one multiplied by it;
2. ``presence_penalty`` and ``frequency_penalty`` (OpenAI's semantics, over *generated* tokens
   only): ``logit -= presence * (count > 0) + frequency * count``;
3. ``temperature``; 4. ``top_k``; 5. ``top_p``; 6. ``min_p``; then softmax.

Probabilities always come out in float32 (float64 for float64 logits), whatever the model's
dtype: the acceptance test compares them with a uniform draw, and bfloat16's 8-bit mantissa
would bias it (a probability of 0.998 rounds to 1.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: The smallest non-zero temperature: below it logits / temperature leaves float32's range
#: for ordinary logits, and the distribution is a one-hot anyway (use 0 for greedy).
MIN_TEMPERATURE = 1e-4
#: The largest temperature: above it every distribution is uniform to float32's precision.
MAX_TEMPERATURE = 100.0


class SamplingParams(BaseModel):
    """Temperature 0 means greedy (argmax of the penalized logits); the filters' neutral
    values (top_k 0, top_p 1.0, min_p 0.0) and the penalties' (1.0, 0.0, 0.0) turn them off."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE,
                               description=f"0 = greedy, else {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass to keep; 1.0 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0,
                         description="keep tokens at least min_p times as likely as the most likely one; 0 = off")
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0,
                                      description="> 1 discourages tokens already in the prompt or output; 1 = off")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0,
                                    description="subtracted from the logit of every token the output already has")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0,
                                     description="times its count in the output, subtracted from a token's logit")

    @field_validator("temperature")
    @classmethod
    def _computable(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}; "
                             "smaller temperatures are greedy to float precision: use 0")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the context (some penalty is on)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class RowSampling(tuple):
    """Each row's own :class:`SamplingParams` (``RowSampling([params_0, params_1, ...])``): what a
    batch of requests with different settings hands the pipeline. Every function below takes one
    wherever it takes a :class:`SamplingParams`; the rows may also be repeated in blocks (``n``
    consecutive logits rows per entry, as a drafter's ``[batch * m, vocab]`` reshape gives).

    ``greedy`` is True when every row is greedy, ``penalized`` when any row is; other attributes
    read through to the settings when all rows share them.
    """

    @property
    def greedy(self) -> bool:
        return all(p.greedy for p in self)

    @property
    def penalized(self) -> bool:
        return any(p.penalized for p in self)

    @property
    def uniform(self) -> "SamplingParams | None":
        """The settings every row shares, or None when rows differ."""
        first = self[0] if len(self) else SamplingParams()
        return first if all(p == first for p in self) else None

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in SamplingParams.model_fields:
            raise AttributeError(name)
        shared = self.uniform
        if shared is None:
            raise AttributeError(f"rows have different sampling settings: read {name} per row (ctx.sampling[b].{name})")
        return getattr(shared, name)

    def rows(self, n: int) -> "RowSampling":
        """The settings of ``n`` logits rows: each entry repeated ``n // len(self)`` times."""
        if n == len(self):
            return self
        if not len(self) or n % len(self):
            raise ValueError(f"{n} logits rows for the sampling settings of {len(self)} rows")
        return RowSampling(p for p in self for _ in range(n // len(self)))


Params = "SamplingParams | RowSampling"


def _row_generators(generator, n: int) -> list:
    """``generator`` (one, None, or a list per row, possibly repeated in blocks) for each of ``n`` rows."""
    if generator is None or not isinstance(generator, (list, tuple)):
        return [generator] * n
    if not generator or n % len(generator):
        raise ValueError(f"{n} rows for {len(generator)} generators")
    return [g for g in generator for _ in range(n // len(generator))]


def _per_row(fn, logits, params, counts):
    """``fn(logits, params, counts)`` for each group of rows that share settings (rows with
    different settings in separate calls; every operation is row by row, so a row's numbers do
    not depend on which rows share its call)."""
    import torch

    if not isinstance(params, RowSampling):
        return fn(logits, params, counts)
    params = params.rows(logits.shape[0])
    shared = params.uniform
    if shared is not None:
        return fn(logits, shared, counts)
    groups: dict[SamplingParams, list[int]] = {}
    for b, p in enumerate(params):
        groups.setdefault(p, []).append(b)
    block = 1 if counts is None else logits.shape[0] // counts.in_context.shape[0]  # logits rows per counts row
    out = None
    for p, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        part = fn(logits[index], p, None if counts is None else counts.select(index // block))
        if out is None:
            out = part.new_empty((logits.shape[0], *part.shape[1:]))
        out[index] = part
    return out


def row_uniforms(generator, widths, device=None) -> "torch.Tensor":
    """Uniforms in [0, 1), float64: ``widths[b]`` of them for row ``b`` from row ``b``'s generator
    (``generator``: one, None or a list per row), padded with 0 to ``[batch, max(widths)]``. A row
    with its own generator draws only its own ``widths[b]``, so its numbers do not depend on its
    batchmates; with one generator the whole block comes from one call."""
    import torch

    widths = [int(w) for w in widths]
    width = max(widths, default=0)
    if not isinstance(generator, (list, tuple)):
        return torch.rand((len(widths), width), generator=generator, device=device, dtype=torch.float64)
    gens = _row_generators(generator, len(widths))
    out = torch.zeros((len(widths), width), device=device, dtype=torch.float64)
    for b, (g, w) in enumerate(zip(gens, widths)):
        out[b, :w] = torch.rand(w, generator=g, device=device, dtype=torch.float64)
    return out


def inverse_cdf(probs: "torch.Tensor", uniform: "torch.Tensor", chunk: int = 64) -> "torch.Tensor":
    """The token of each row of ``probs # [batch, vocab]`` (non-negative, any positive total) at
    ``uniform # [batch]`` in [0, 1): the first whose cumulative probability, in float64, exceeds
    ``uniform * total``. Exactly a draw from the row's distribution up to float64 rounding; a token of
    probability 0 is never drawn.  # [batch]"""
    import torch

    if probs.shape[0] <= chunk:
        return _inverse_cdf(probs, uniform)
    return torch.cat([_inverse_cdf(probs[i : i + chunk], uniform[i : i + chunk])  # float64 sums of a few rows at a time
                      for i in range(0, probs.shape[0], chunk)])


def _inverse_cdf(probs, uniform):
    import torch

    cdf = probs.double().cumsum(-1)  # [rows, vocab]
    total = cdf[:, -1:]
    # below the total even where u * total rounds up to it: the last token of positive probability then
    u = torch.minimum(uniform.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def sample_rows(probs: "torch.Tensor", generator=None) -> "torch.Tensor":
    """One token per row of ``probs # [batch, vocab]``; ``generator``: one, or one per row (each row
    draws from its own, so a request's draws do not depend on its batchmates).  # [batch]"""
    return inverse_cdf(probs, row_uniforms(generator, [1] * probs.shape[0], probs.device)[:, 0])


@dataclass(frozen=True)
class TokenCounts:
    """What the penalties read of each row's context, at one position or at several.

    ``in_context  # [batch, (positions,) vocab]`` bool: the token occurs in the prompt, the
    output or the drafts before the position (repetition penalty);
    ``in_output   # [batch, (positions,) vocab]`` float32: how often it occurs in the generated
    part, drafts before the position included (presence and frequency penalties).
    """

    in_context: "torch.Tensor"
    in_output: "torch.Tensor"

    @classmethod
    def of(cls, token_ids: Sequence[Sequence[int]], prompt_lengths: Sequence[int], vocab: int,
           device=None) -> "TokenCounts":
        """Counts of every row's tokens ``token_ids[b]`` whose first ``prompt_lengths[b]`` are its prompt."""
        import torch

        batch = len(token_ids)
        rows = torch.tensor([b for b, t in enumerate(token_ids) for _ in t], dtype=torch.long)
        ids = torch.tensor([i for t in token_ids for i in t], dtype=torch.long)
        generated = torch.tensor([j >= n for t, n in zip(token_ids, prompt_lengths) for j in range(len(t))])
        in_context = torch.zeros((batch, vocab), dtype=torch.bool)
        in_context[rows, ids] = True
        in_output = torch.zeros((batch, vocab), dtype=torch.float32)
        in_output.index_put_((rows[generated], ids[generated]), torch.ones(int(generated.sum())), accumulate=True)
        return cls(in_context.to(device), in_output.to(device))

    def row(self, b: int, n: int | None = None) -> "TokenCounts":
        """Row ``b``'s counts (batch dim kept), for ``n`` logits rows (rows repeated in blocks)."""
        batch = self.in_context.shape[0]
        b = b // ((n or batch) // batch)
        return TokenCounts(self.in_context[b : b + 1], self.in_output[b : b + 1])

    def select(self, index) -> "TokenCounts":
        """The counts of the rows ``index`` (a slice, a list or a long tensor of rows)."""
        return TokenCounts(self.in_context[index], self.in_output[index])

    def plus(self, tokens: "torch.Tensor") -> "TokenCounts":
        """The counts after every row generated ``tokens # [batch, n]`` more (drafts so far)."""
        if tokens.shape[-1] == 0:
            return self
        added = self._one_hot(tokens).sum(1)  # [batch, vocab]
        return TokenCounts(self.in_context | (added > 0), self.in_output + added)

    def along(self, tokens: "torch.Tensor") -> "TokenCounts":
        """Counts at each of ``n + 1`` positions ``# [batch, n + 1, vocab]``: position ``j`` after
        ``tokens[:, :j]`` (``tokens # [batch, n]``, a draft being verified)."""
        import torch

        added = torch.cat([torch.zeros_like(self.in_output[:, None]), self._one_hot(tokens).cumsum(1)], 1)
        return TokenCounts(self.in_context[:, None] | (added > 0), self.in_output[:, None] + added)

    def along_tree(self, tokens: "torch.Tensor", ancestors: "torch.Tensor") -> "TokenCounts":
        """Counts at each pass index of a tree ``# [batch, n + 1, vocab]``: index ``j`` after the
        tokens of its ancestors and itself (``tokens # [batch, n]`` the nodes, ``ancestors
        # [batch, n + 1, n + 1]`` bool as :func:`~specdraft.verifier.tree.tree_ancestors` gives)."""
        added = ancestors[:, :, 1:].to(self.in_output.dtype) @ self._one_hot(tokens)  # [batch, n + 1, vocab]
        return TokenCounts(self.in_context[:, None] | (added > 0), self.in_output[:, None] + added)

    def _one_hot(self, tokens: "torch.Tensor") -> "torch.Tensor":
        import torch

        vocab = self.in_output.shape[-1]
        return torch.nn.functional.one_hot(tokens.to(self.in_output.device).long(), vocab).to(self.in_output.dtype)


def compute_dtype(dtype: "torch.dtype") -> "torch.dtype":
    """The dtype acceptance arithmetic runs in for inputs of ``dtype``: float32 or wider."""
    import torch

    return torch.promote_types(dtype, torch.float32)


def penalize(logits: "torch.Tensor", params: Params, counts: TokenCounts | None) -> "torch.Tensor":
    """Steps 1-2 of the pipeline; ``logits # [..., vocab]`` (the same leading shape as ``counts``),
    returned in :func:`compute_dtype`. Unchanged (but upcast) when no penalty is on, or when
    ``counts`` is None: a drafter that does not pass its context drafts from unpenalized
    distributions, which stays exact (only the target's must be right) but is accepted less."""
    import torch

    if isinstance(params, RowSampling):
        return _per_row(penalize, logits, params, counts)
    logits = logits.to(compute_dtype(logits.dtype))
    if not params.penalized or counts is None:
        return logits
    if params.repetition_penalty != 1.0:
        penalty = params.repetition_penalty
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(counts.in_context, scaled, logits)
    if params.presence_penalty or params.frequency_penalty:
        output = counts.in_output.to(logits.dtype)
        logits = logits - params.presence_penalty * (output > 0).to(logits.dtype) - params.frequency_penalty * output
    return logits


def process_logits(logits: "torch.Tensor", params: Params, counts: TokenCounts | None = None) -> "torch.Tensor":
    """The whole pipeline but the softmax, for sampling settings (temperature > 0).

    ``logits # [..., vocab]`` -> ``# [..., vocab]`` in float32 or wider; filtered tokens are -inf.
    Top-k keeps every token whose logit is >= the k-th largest (ties are kept). Top-p keeps the
    smallest prefix of tokens, in descending order, whose mass reaches ``top_p`` (the most
    likely token is always kept). Min-p keeps tokens whose probability is at least ``min_p``
    times the most likely one's.
    """
    import torch

    if isinstance(params, RowSampling):
        return _per_row(process_logits, logits, params, counts)
    logits = penalize(logits, params, counts) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        floor = logits.amax(-1, keepdim=True) + math.log(params.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def argmax(logits: "torch.Tensor") -> "torch.Tensor":
    """``logits.argmax(-1)``: the first index of the largest entry ``# [...]`` of ``logits # [...,
    vocab]``. On a CPU, bfloat16 and float16 logits are widened to float32 first: the same index
    (widening is exact, so order, ties and NaNs stay as they were), and torch's own reduction over
    half-width entries is five times slower there (0.17 ms against 0.03 ms a row of 49,152 on an
    AMD EPYC: 1.5% of the default model's step)."""
    import torch

    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(-1)


def greedy_tokens(logits: "torch.Tensor", params: Params, counts: TokenCounts | None = None) -> "torch.Tensor":
    """Greedy decoding's choice ``# [...]``: the argmax of the penalized logits ``# [..., vocab]``
    (of the logits as they are when no penalty is on, so ties break as plain decoding's do)."""
    if isinstance(params, RowSampling):
        return _per_row(greedy_tokens, logits, params, counts)
    if not params.penalized:
        return argmax(logits)
    return argmax(penalize(logits, params, counts))


def logits_to_probs(logits: "torch.Tensor", params: Params, counts: TokenCounts | None = None) -> "torch.Tensor":
    """The sampling distribution: ``logits # [..., vocab]`` -> ``# [..., vocab]``, rows summing to 1,
    filtered tokens exactly 0, in float32 or wider whatever the logits' dtype.

    ``counts`` (see :class:`TokenCounts`) is each position's context; it is needed only when a
    penalty is on. Greedy settings give a one-hot at :func:`greedy_tokens`.
    """
    import torch

    if isinstance(params, RowSampling):
        return _per_row(logits_to_probs, logits, params, counts)
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits, params, counts),
                                           logits.shape[-1]).to(compute_dtype(logits.dtype))
    return process_logits(logits, params, counts).softmax(-1)


def restrict(probs: "torch.Tensor", params: Params) -> "torch.Tensor":
    """The pipeline's filters (top-k, top-p, min-p) applied to a distribution ``probs # [..., vocab]``
    that is already a mixture (a copy gate's), renormalized; greedy settings return it as it is.

    A drafter that mixes its processed distribution with something else restricts the mixture
    this way, so it never drafts a token the filters would give probability 0.
    """
    if isinstance(params, RowSampling):
        return _per_row(lambda x, p, _: restrict(x, p), probs, params, None)
    if params.greedy:
        return probs
    plain = params.model_copy(update={"temperature": 1.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                      "frequency_penalty": 0.0})
    return process_logits(probs.log(), plain).softmax(-1)


def draw(logits: "torch.Tensor", params: Params, generator=None, counts: TokenCounts | None = None):
    """One draft token per row from ``logits # [batch, vocab]``, the way drafters must draw it.

    Returns ``(tokens # [batch], probs # [batch, vocab] | None)``: the greedy choice and None
    when greedy, else a sample from ``logits_to_probs(logits, params, counts)`` and those
    probabilities (what the drafter reports as ``Draft.probs``; a greedy row among sampled ones
    gets its one-hot). ``generator``: one, or one per row (``ctx.generators``).
    """
    if params.greedy:
        return greedy_tokens(logits, params, counts), None
    probs = logits_to_probs(logits, params, counts)
    return sample_rows(probs, generator), probs
