"""Drafters: one module per drafter (``heads/`` is one package for three), the API they import
(:mod:`specdraft.drafters.api`), and the machinery the built-ins share (``common/``)."""

from .api import Drafter, NoOptions

__all__ = ["Drafter", "NoOptions"]
