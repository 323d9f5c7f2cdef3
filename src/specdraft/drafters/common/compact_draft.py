"""A compact draft model for a given target: a few decoder layers, the target's embeddings.

It is an ordinary transformers ``LlamaForCausalLM`` (so the verifier's cache and forward
path run it unchanged) with two twists that keep it small on disk and fast per token:

* the input embedding is the target's own module, shared, not a copy;
* the output head has rows for the ``N`` most frequent tokens only (``head_ids``); logits
  of every other token are the most negative float, so their probability is exactly 0,
  which rejection sampling handles exactly;
* optionally a copy gate (:class:`~specdraft.drafters.common.copy_gate.CopyGate`, a
  pointer-generator for drafting): the draft's distribution is a learnt mixture of its own
  and the token that followed the last occurrence of the trailing n-gram.

On disk (``save_compact_draft``): ``config.json`` (the draft's LlamaConfig),
``specdraft_draft.json`` (format, the target's name and fingerprint), and
``model.safetensors`` (decoder layers, final norm, head rows and ``head_ids``; no
embeddings).
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError
from .copy_gate import STATE_PREFIX, CopyGate

FORMAT_FILE = "specdraft_draft.json"
FORMAT = "specdraft-compact-draft/1"


def target_fingerprint(embedding_weight: torch.Tensor) -> str:
    """A short hash of the target's embedding matrix: identifies the target a draft was trained for.

    It hashes the shape and the *signs* of a strided sample of rows, so the same target gives
    the same fingerprint whatever precision it was loaded in (float32, bfloat16 on a GPU,
    float16, float64), while a different model, or a fine-tune of this one, gives another.
    """
    rows = embedding_weight.shape[0]
    step = 97 if rows > 97 * 16 else 1  # small vocabularies: every row (row 0 alone may be padding)
    sample = embedding_weight.detach()[::step]
    signs = (sample > 0).flatten().cpu().numpy()
    h = hashlib.sha256(f"signs|{tuple(embedding_weight.shape)}".encode())
    h.update(np.packbits(signs).tobytes())
    return h.hexdigest()[:16]


class ScatteredHead(torch.nn.Module):
    """Logits for ``head_ids`` only, scattered into the full vocabulary (min-float elsewhere)."""

    def __init__(self, hidden: int, head_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, head_ids.numel(), bias=False)
        self.register_buffer("head_ids", head_ids.long(), persistent=True)
        self.vocab_size = vocab_size

    #: False (inside :meth:`unscattered`): return the ``N`` head logits only (``[..., N]``)
    scatter: bool = True

    @contextmanager
    def unscattered(self):
        """Within the block the head returns its own ``[..., N]`` logits, for callers that map ids themselves."""
        self.scatter = False
        try:
            yield
        finally:
            self.scatter = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.proj(hidden)  # [..., N]
        if not self.scatter:
            return small
        full = torch.full((*small.shape[:-1], self.vocab_size), torch.finfo(small.dtype).min,
                          dtype=small.dtype, device=small.device)
        return full.index_copy_(-1, self.head_ids, small)  # [..., vocab]


def build_compact_draft(target, num_layers: int, head_ids: torch.Tensor, init_layers: list[int] | None = None):
    """A draft for ``target`` (a Llama-family HF model) initialised from some of its layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tcfg = target.config.get_text_config()
    if tcfg.model_type != "llama":
        raise ConfigError(f"compact drafts are built from Llama-family targets; this target is {tcfg.model_type!r}")
    cfg = LlamaConfig(**{**tcfg.to_dict(), "num_hidden_layers": num_layers, "tie_word_embeddings": False})
    draft = LlamaForCausalLM(cfg).to(dtype=target.dtype, device=target.device)
    init_layers = init_layers if init_layers is not None else list(range(num_layers))
    with torch.no_grad():
        for mine, theirs in zip(draft.model.layers, init_layers):
            mine.load_state_dict(target.model.layers[theirs].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        head = ScatteredHead(cfg.hidden_size, head_ids, cfg.vocab_size).to(dtype=target.dtype, device=target.device)
        head.proj.weight.copy_(target.get_output_embeddings().weight[head_ids])
    draft.lm_head = head
    draft.model.embed_tokens = target.get_input_embeddings()  # shared, not copied
    return draft


def trainable_state(draft) -> dict[str, torch.Tensor]:
    """Everything the draft owns (no shared embeddings)."""
    return {k: v for k, v in draft.state_dict().items() if not k.startswith("model.embed_tokens.")}


def save_compact_draft(draft, path: str | Path, target_name: str, fingerprint: str, dtype=torch.bfloat16,
                       extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    from ...files import write_atomic

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # the copy gate's few weights stay in float32: its logit adds terms of very different sizes
    state = {k: (v.to(torch.float32 if k.startswith(STATE_PREFIX) else dtype) if v.is_floating_point() else v)
             .contiguous().cpu() for k, v in trainable_state(draft).items()}
    write_atomic(path / "model.safetensors", lambda tmp: save_file(state, tmp))
    write_atomic(path / "config.json", draft.config.to_json_string())
    meta = {"format": FORMAT, "target": target_name, "target_fingerprint": fingerprint,
            "head_tokens": int(draft.lm_head.head_ids.numel()), **(extra or {})}
    gate = getattr(draft, "copy_gate", None)
    if gate is not None:
        meta["copy_gate"] = {**gate.spec(), **meta.get("copy_gate", {})}
    write_atomic(path / FORMAT_FILE, json.dumps(meta, indent=1))  # last: it marks the folder complete


def is_compact_draft(path: str | Path) -> bool:
    return (Path(path) / FORMAT_FILE).is_file()


def load_compact_draft(path: str | Path, embeddings: Any, target_name: str, dtype, device):
    """Load a draft saved by :func:`save_compact_draft` onto the target's ``embeddings`` module."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .weights import load_weights

    path = Path(path)
    meta = json.loads((path / FORMAT_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is in format {meta.get('format')!r}; this specdraft reads {FORMAT!r}")
    if embeddings is None:
        raise ConfigError(f"the draft in {path} shares the target's embeddings; load it through a SpeculativeDecoder")
    fingerprint = target_fingerprint(embeddings.weight)
    if meta["target_fingerprint"] != fingerprint:
        raise ConfigError(
            f"the draft in {path} was trained for target {meta['target']!r} (fingerprint {meta['target_fingerprint']}), "
            f"not for {target_name!r} (fingerprint {fingerprint}); train one for this target with `specdraft distill`"
        )
    cfg = LlamaConfig.from_json_file(path / "config.json")
    state = load_weights(path / "model.safetensors")
    draft = LlamaForCausalLM(cfg)
    draft.lm_head = ScatteredHead(cfg.hidden_size, state["lm_head.head_ids"], cfg.vocab_size)
    if "copy_gate" in meta:
        draft.copy_gate = CopyGate.from_spec(meta["copy_gate"], cfg.hidden_size)
    draft.model.embed_tokens = torch.nn.Embedding(1, 1)  # placeholder, replaced below
    missing = draft.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()},
                                    strict=False)
    unexpected = [k for k in missing.missing_keys if not k.startswith("model.embed_tokens.")]
    if unexpected or missing.unexpected_keys:
        raise ConfigError(f"{path}/model.safetensors does not match its config: missing {unexpected}, "
                          f"unexpected {missing.unexpected_keys}")
    draft.model.embed_tokens = embeddings
    return draft.to(dtype=dtype, device=device).eval(), meta
