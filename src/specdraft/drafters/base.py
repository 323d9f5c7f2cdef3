"""The drafter interface: propose tokens, then hear back how many were accepted."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from ..types import Draft, DraftContext, TargetInfo


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Drafter(ABC):
    """Base class of every drafter, built-in or third-party.

    Lifecycle, driven by the verifier:

    1. ``__init__(options, target)`` once, with the drafter's own validated ``Options``
       and a :class:`~specdraft.TargetInfo` describing the target model; it ends by
       calling ``reset()``, so per-request state exists from the start.
    2. ``reset()`` at the start of every ``generate`` call (a new batch of requests).
    3. each round: ``propose(ctx, k)`` returns up to ``k`` tokens per row, the target
       verifies them, then ``on_verified(ctx, num_accepted)`` reports how many of each
       row's tokens were accepted (``ctx.token_ids`` already includes them, plus the
       target's correction or bonus token).

    A drafter keeps whatever per-row state it likes between calls, keyed by row index;
    ``ctx.token_ids[b]`` always holds the full, authoritative sequence.
    """

    #: Options this drafter accepts (pydantic, ``extra="forbid"`` so typos fail loudly).
    Options: ClassVar[type[BaseModel]] = NoOptions

    #: Set by the registry: the name the drafter was created under, and its plugin.
    name: str = ""
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

    def reset(self) -> None:  # noqa: B027
        """Forget all per-request state (called at the start of every generate call)."""
