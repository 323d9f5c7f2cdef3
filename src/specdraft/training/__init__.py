"""Training learnt drafters (draft models now, heads later) with one loop and one data path."""

from .data import generate_sequences, load_prompts
from .loop import train

__all__ = ["generate_sequences", "load_prompts", "train"]
