"""Drafters that read the target's hidden states: Medusa, EAGLE and the multi-stage MLP speculator."""

from .drafters import Eagle3Drafter, EagleDrafter, HeadDrafter, MedusaDrafter, MLPSpeculatorDrafter

__all__ = ["Eagle3Drafter", "EagleDrafter", "HeadDrafter", "MLPSpeculatorDrafter", "MedusaDrafter"]
