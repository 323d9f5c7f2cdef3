"""A request as the engine sees it: :class:`Sequence`, and its own random numbers."""

from __future__ import annotations

import enum
import itertools
import queue
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from typing import Sequence as Seq

import torch

from ..settings import GenerationSettings
from ..types import GenerationStats
from ..verifier.prediction import MAX_PREDICTED, Prediction
from .policy import AdaptiveDraftLength

if TYPE_CHECKING:  # pragma: no cover
    from .prefix import Block
    from ..grammar import GrammarMatcher

#: How likely a predicted token is taken to be accepted before the request has shown it.
PREDICTION_PRIOR = 0.8

_ids = itertools.count()
_MASK = 2**64 - 1


def mix_seed(*values: int) -> int:
    """A 64-bit seed from integers (splitmix64 over them): the same values give the same seed."""
    z = 0x9E3779B97F4A7C15
    for v in values:
        z = (z ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        z ^= z >> 31
    return z


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Outbox:
    """Where a sequence's output events go (``("tokens", ids)``, then ``("done", None)``): a queue
    any thread may read, and ``on_put``, a callback run (on the putting thread) after each event,
    so that a reader need not block a thread of its own on :meth:`get` (the server's output loop)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.on_put = None

    def put(self, event: tuple) -> None:
        self._queue.put(event)
        callback = self.on_put
        if callback is not None:
            callback()

    def get(self) -> tuple:
        """The next event, waiting for it."""
        return self._queue.get()

    def get_nowait(self) -> tuple | None:
        """The next event, or None if there is none yet."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def empty(self) -> bool:
        return self._queue.empty()


@dataclass(eq=False)
class Sequence:
    """One request: its tokens (prompt + output, the very list drafters see), its settings, its
    own random numbers, its limits, and where its output goes (``events``, read by the caller).

    Random numbers: every round the sequence's two generators are reseeded from its ``seed`` and
    its length (one for its draft, one for its verification), so what it draws depends on
    nothing but its own seed and tokens, never on what else shares the batch.
    """

    tokens: list[int]
    #: what the request asked for (shared by the prompts and choices of one call; read through the
    #: properties below)
    settings: GenerationSettings
    max_len: int  # prompt + output may not exceed this (the model's context, or less)
    #: this sequence's own seed (the request's mixed with its prompt and choice); None: random
    seed: int | None = None
    id: int = field(default_factory=lambda: next(_ids))
    prompt_len: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: BaseException | None = None
    slot: int | None = None  # the target cache row it holds while running
    #: tokens whose keys and values the target cache holds: all but the last once it decodes; while
    #: its prompt is prefilled (chunk by chunk), the prompt tokens prefilled so far
    cached: int = 0
    #: the target's hidden states of the prompt's prefilled chunks, for a drafter that asks for them
    prefill_states: list = field(default_factory=list, repr=False)
    #: the prefix cache's block of the prompt pass that ends at ``cached`` while prefilling (the
    #: next pass is looked up and kept after it); None: at the start, or the chain broke
    prefix_block: "Block | None" = field(default=None, repr=False)
    #: the engine's prefill step count when it joined: how long its prompt has waited (the prefill order)
    filling_since: int = 0
    #: where the prompt's turn marks end (extra prefill pass ends; see Engine._pass_end); None: not found yet
    turn_ends: list[int] | None = field(default=None, repr=False)
    stats: GenerationStats = field(default_factory=GenerationStats)
    events: Outbox = field(default_factory=Outbox)
    submitted: float = field(default_factory=time.perf_counter)
    #: perf_counter when it got a slot, and when its first and latest output were committed (None:
    #: not yet); see :mod:`specdraft.engine.report`
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    aborted: bool = False
    #: the request's predicted output (token ids), drafted from instead of the drafter (see
    #: :mod:`specdraft.verifier.prediction`); None: none
    prediction: Prediction | None = None
    #: structured output: the request's place in its grammar (see :mod:`specdraft.grammar`),
    #: which masks the target's distribution at every verified position; None: unconstrained
    grammar: "GrammarMatcher | None" = field(default=None, repr=False)
    #: a :class:`~specdraft.types.TokenLogprob` per output token when ``logprobs`` is set, appended
    #: with the tokens (before their ``("tokens", ...)`` event)
    output_logprobs: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.tokens)
        #: how long a predicted draft pays (per request: each prediction has its own quality)
        self.prediction_policy = (AdaptiveDraftLength(MAX_PREDICTED, prior=PREDICTION_PRIOR, time_plain=False)
                                  if self.prediction is not None else None)
        self.prompt_len = self.prompt_len or len(self.tokens)
        self.stats.prompt_tokens = self.prompt_len
        self._seed = self.seed if self.seed is not None else random.SystemRandom().getrandbits(64)
        self._generators: dict = {}

    # the request's settings, read through
    sampling = property(lambda self: self.settings.sampling, doc="the sampling pipeline's settings")
    max_new_tokens = property(lambda self: self.settings.max_new_tokens)
    stop = property(lambda self: self.settings.stop, doc="stop strings")
    #: EOS does not end the request (it is emitted like any other token)
    ignore_eos = property(lambda self: self.settings.ignore_eos)
    #: the first ``min_tokens`` output tokens are never EOS or a stop token (the target's
    #: distribution puts 0 on them there), and stop strings do not end the request before them
    min_tokens = property(lambda self: self.settings.min_tokens)
    #: tokens that end the request as EOS does (finish reason "stop"); kept in ``tokens``, not in the text
    stop_token_ids = property(lambda self: self.settings.stop_token_ids)
    #: log-probabilities asked for: the most likely tokens to report at each output position
    #: (0-20; 0: the output token's own only), None: none (see :mod:`specdraft.engine.logprobs`)
    logprobs = property(lambda self: self.settings.logprobs)
    #: "processed" (the distribution each token was drawn from) or "raw" (the model's logits)
    logprobs_mode = property(lambda self: self.settings.logprobs_mode)
    #: token id -> a number added to its logit at every position before the sampling pipeline
    #: (OpenAI's ``logit_bias``; -100 bans a token, 100 all but forces it); None: none
    logit_bias = property(lambda self: self.settings.token_bias)

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def prefilling(self) -> bool:
        """Whether some of the prompt (all but its last token) is still to be prefilled."""
        return self.cached < self.prompt_len - 1

    @property
    def fixed_draft_length(self) -> bool:
        """Seeded sampling drafts a fixed length: a length chosen from timings or from its
        batchmates' acceptance would change which random numbers it draws, so its output."""
        return self.seed is not None and not self.sampling.greedy

    def early_stops(self, eos_token_ids: Seq[int]) -> tuple[int, ...]:
        """The tokens ``min_tokens`` holds back: the stop tokens, and EOS unless ``ignore_eos`` (vLLM's set)."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(sorted(set(self.stop_token_ids) | set(eos)))

    def generator(self, kind: int, device) -> torch.Generator:
        """This round's generator ``kind`` (0: drafting, 1: verification), reseeded from the seed
        and the sequence's length."""
        device = torch.device(device)
        key = (kind, device)
        gen = self._generators.get(key)
        if gen is None:
            gen = self._generators[key] = torch.Generator(device=device)
        gen.manual_seed(mix_seed(self._seed, len(self.tokens), kind))
        return gen

    def finish(self, reason: str) -> None:
        """The request is over (``reason``: its ``finish_reason``); its reader gets ``("done", None)``."""
        self.finish_reason = reason
        self.status = Status.FINISHED
        self.stats.new_tokens = len(self.new_tokens)
        self.stats.total_time_s = time.perf_counter() - self.submitted
        self.events.put(("done", None))


def sequences_for(prompts: Seq[Seq[int]], settings: "GenerationSettings | Seq[GenerationSettings]",
                  max_context: int, *, predictions: "Seq[Seq[int] | None] | None" = None,
                  grammars: Seq | None = None) -> list[Sequence]:
    """The :class:`Sequence`\\ s of one call: prompt ``i`` with ``settings[i]`` (or the one
    ``settings`` for every prompt), its ``n`` choices one after another (the prefix cache
    prefills their prompt once), prompt by prompt. A call's seed gives each prompt its own (its index mixed in), so the same
    call gives the same outputs however it is batched; choice ``j > 0`` of prompt ``i`` gets the
    seed ``mix_seed(seed, i, j)`` (choice 0 what ``n=1`` gives). ``predictions[i]``: prompt
    ``i``'s predicted output, token ids (None or empty: none); ``grammars[i]``: its compiled
    :class:`~specdraft.grammar.Grammar` (structured output; None: none), of which each
    choice gets a matcher. Everything is checked already."""
    each = [settings] * len(prompts) if isinstance(settings, GenerationSettings) else list(settings)
    predictions = predictions or [None] * len(prompts)
    grammars = grammars or [None] * len(prompts)
    sequences = []
    for i, (prompt, request, predicted, grammar) in enumerate(zip(prompts, each, predictions, grammars)):
        seed = request.seed
        room = min(max_context, len(prompt) + request.max_new_tokens)
        sequences += [Sequence(tokens=list(prompt), settings=request, max_len=room,
                               seed=None if seed is None else mix_seed(seed, i, *([j] if j else [])),
                               prediction=Prediction(list(predicted)) if predicted else None,
                               grammar=None if grammar is None else grammar.matcher())
                      for j in range(request.n)]
    return sequences
