"""Benchmarks: specdraft's drafters against plain decoding and transformers, side by side."""

from .harness import BenchInterrupted, BenchSettings, load_questions, run_bench, write_outputs
from .report import RunRecord, expected_tokens_per_round, markdown, summarize

__all__ = ["BenchInterrupted", "BenchSettings", "RunRecord", "expected_tokens_per_round", "load_questions",
           "markdown", "run_bench", "summarize", "write_outputs"]
