"""transformers' own model, eager, for architectures specdraft's model code does not reproduce.

:class:`TransformersRunner` has the :class:`~specdraft.runner.runner.ModelRunner` interface over
transformers' module, with a preallocated cache that transformers' attention writes into
(:class:`~specdraft.cache.hf.HFCache`, the interface of :mod:`specdraft.cache`).
"""

from __future__ import annotations

import torch

from ..cache.hf import HFCache
from .base import RunnerBase, attention_backends
from .model import hidden_layers


class TransformersRunner(RunnerBase):
    """transformers' model as a runner (eager, float or whatever it was loaded as)."""

    implementation = "transformers"
    compile_seconds = 0.0

    def __init__(self, hf_model, reason: str = "") -> None:
        self.model = hf_model
        self.fallback_reason = reason  # why specdraft's own model code does not run it
        self.cache = HFCache(hf_model.config.get_text_config().num_hidden_layers)
        self.cache.device = hf_model.device

    def warm_up(self, rows: int, widths) -> None:
        """Nothing to compile."""

    def forward(self, tokens: torch.Tensor, logits_at: torch.Tensor | None = None, hidden: bool = False,
                advance=None, slots=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.cache.rows(None if slots is None else [int(s) for s in slots]):
            return self._forward(tokens, logits_at, hidden, advance)

    def _forward(self, tokens, logits_at, hidden, advance):
        rows = len(self.cache.stored)
        width = tokens.shape[1]
        position_ids, mask = self.cache.prepare(width, tokens.device, self.model.dtype)
        keep = 0
        if logits_at is not None:  # only the last positions asked for need the LM head
            keep = width - int(logits_at.min())
        with attention_backends(tokens.device):
            out = self.model(input_ids=tokens, position_ids=position_ids, attention_mask=mask,
                             past_key_values=self.cache, use_cache=True, logits_to_keep=keep,
                             output_hidden_states=bool(hidden))
        logits = out.logits  # [rows, keep or W, vocab]
        if logits_at is not None:
            index = logits_at - (width - logits.shape[1])  # [rows, N]
            logits = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
        self.cache.advance([width] * rows if advance is None else list(torch.as_tensor(advance).tolist()))
        if not hidden:
            return logits, None
        layers = hidden_layers(hidden, len(out.hidden_states) - 1)
        return logits, torch.cat([out.hidden_states[i] for i in layers], -1) if layers else out.hidden_states[-1]
