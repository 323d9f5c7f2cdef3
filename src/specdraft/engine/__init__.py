"""The engine: sequences, scheduling, continuous batching; each step's round runs the verifier."""

from .engine import Engine, EngineLoop
from .output import GenerationInterrupted
from .scheduler import Scheduler
from .sequence import Sequence
from .stream import Stream, StreamChunk

__all__ = ["Engine", "EngineLoop", "GenerationInterrupted", "Scheduler", "Sequence", "Stream", "StreamChunk"]
