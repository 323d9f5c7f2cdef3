"""Drafters: one module per drafter, and the base class they share."""

from .base import Drafter, NoOptions

__all__ = ["Drafter", "NoOptions"]
