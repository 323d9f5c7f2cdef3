"""The verifier: one batched K+1 target pass per round and exact acceptance."""

from .engine import GenerationInterrupted, Verifier, check_draft
from .rejection import greedy_accept, rejection_sample

__all__ = ["GenerationInterrupted", "Verifier", "check_draft", "greedy_accept", "rejection_sample"]
