"""Drafters that read the target's hidden states: Medusa, EAGLE and the multi-stage MLP speculator."""

from .drafters import EagleDrafter, HeadDrafter, MedusaDrafter, MLPSpeculatorDrafter

__all__ = ["EagleDrafter", "HeadDrafter", "MLPSpeculatorDrafter", "MedusaDrafter"]
