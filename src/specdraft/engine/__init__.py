"""The engine: sequences, continuous batching, one batched K+1 target pass per step, exact acceptance."""

from .engine import Engine, EngineLoop
from .rejection import greedy_accept, rejection_sample
from .sequence import Sequence
from .stream import Stream, StreamChunk
from .verify import GenerationInterrupted, check_draft

__all__ = ["Engine", "EngineLoop", "GenerationInterrupted", "Sequence", "Stream", "StreamChunk", "check_draft",
           "greedy_accept", "rejection_sample"]
