"""The three head architectures, as plain ``nn.Module``s that read the target's hidden states.

Notation: ``f_t`` is the target's last-layer hidden state at position ``t`` (after its final
norm, what its LM head reads); ``x_t`` the token at position ``t``. The target itself
turns ``f_t`` into ``x_{t+1}``; heads guess further ahead.

* :class:`MedusaHeads` (Medusa-1): head ``i`` (1-based) is ``i`` residual SiLU blocks on
  ``f_t`` followed by an LM head and guesses ``x_{t+i+1}``; the heads run in parallel.
* :class:`EagleDraft` (EAGLE-1): one decoder layer over ``fc([embed(x_{t+1}) ; f_t])``
  predicts ``f_{t+1}``, autoregressively at the feature level, with its own KV cache;
  the target's LM head turns predicted features into tokens.
* :class:`MLPSpeculator` (multi-stage, after IBM's MLP speculator): stage ``i`` mixes the
  previous stage's state with the embedding of the token chosen at stage ``i-1`` (stage 1:
  ``f_t`` and ``x_{t+1}``), so each guess is conditioned on the one before it.

Every kind shares the target's embeddings and LM head (:class:`SharedHead`, optionally
restricted to a frequent-token vocabulary) instead of owning copies.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...cache import attention_backends

KINDS = ("medusa", "eagle", "mlp-speculator")


class SharedHead(nn.Module):
    """The target's LM head, over all tokens or only ``head_ids`` (a frequency-trimmed vocabulary).

    The weight rows are taken from the target at load time and never saved or trained; only
    ``head_ids`` is part of the heads' state. ``forward`` gives full-vocabulary logits with
    the most negative float outside ``head_ids`` (probability exactly 0 after softmax);
    ``small`` gives the logits of ``head_ids`` only, for training.
    """

    def __init__(self, lm_head: nn.Module, vocab_size: int, head_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        weight = lm_head.weight.detach()
        self.register_buffer("head_ids", None if head_ids is None else head_ids.long().to(weight.device))
        rows = weight if head_ids is None else weight[self.head_ids]
        self.register_buffer("weight", rows, persistent=False)  # [N, hidden], the target's own rows
        self.bias = getattr(lm_head, "bias", None)

    def small(self, hidden: torch.Tensor) -> torch.Tensor:
        from ...fastpath import few_row_linear

        bias = None if self.bias is None else (self.bias if self.head_ids is None else self.bias[self.head_ids])
        return few_row_linear(hidden, self.weight, bias)  # [..., N]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.small(hidden)
        if self.head_ids is None:
            return small
        full = torch.full((*small.shape[:-1], self.vocab_size), torch.finfo(small.dtype).min,
                          dtype=small.dtype, device=small.device)
        return full.index_copy_(-1, self.head_ids, small)  # [..., vocab]

    def to_small(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> indices into ``head_ids`` (-100, ignored by cross-entropy, outside it)."""
        if self.head_ids is None:
            return token_ids
        from ..copy_gate import column_table

        return column_table(self.head_ids, self.vocab_size, missing=-100).to(token_ids.device)[token_ids]


class ResBlock(nn.Module):
    """Medusa's block: ``x + SiLU(W x + b)``, with ``W`` and ``b`` zero-initialised: it starts as the identity."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    kind = "medusa"

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1) -> None:
        super().__init__()
        self.config = {"hidden_size": hidden_size, "num_heads": num_heads, "num_layers": num_layers}
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads)
        )
        #: per-head LM heads of published Medusa checkpoints (None: the target's, shared)
        self.own_heads: nn.ModuleList | None = None

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """``hidden # [..., H]`` -> each head's feature ``# [..., count, H]`` (first ``count`` heads)."""
        return torch.stack([block(hidden) for block in self.blocks[: count or self.num_heads]], dim=-2)

    def logits(self, features: torch.Tensor, shared: SharedHead) -> torch.Tensor:
        """``features # [..., m, H]`` -> ``[..., m, vocab]``."""
        if self.own_heads is None:
            return shared(features)
        return torch.stack([head(features[..., i, :]) for i, head in enumerate(self.own_heads[: features.shape[-2]])],
                           dim=-2)


#: what an EAGLE layer takes from the target's config (and what its saved config holds)
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "head_dim", "vocab_size",
                "hidden_act", "attention_bias", "mlp_bias")


def layer_fields(config: Any) -> dict:
    src = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {k: src[k] for k in LAYER_FIELDS if src.get(k) is not None}


def eagle_layer_config(target_config: Any, **overrides):
    """A one-layer LlamaConfig with the target's attention and MLP shapes."""
    from transformers import LlamaConfig

    values = layer_fields(target_config)
    values.update(overrides)
    values["num_hidden_layers"] = 1
    cfg = LlamaConfig(**values)
    cfg._attn_implementation = "sdpa"
    return cfg


class EagleDraft(nn.Module):
    kind = "eagle"

    def __init__(self, config, fc_bias: bool = True) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        self.llama_config = config
        hidden = config.hidden_size
        self.config = {"hidden_size": hidden, "fc_bias": fc_bias, "layer": layer_fields(config)}
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()  # EAGLE-1: fc's output enters attention unnormalised
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """``features`` (``f_t``) and ``embeds`` (``embed(x_{t+1})``) ``# [B, n, H]`` -> ``f_{t+1}`` guesses ``# [B, n, H]``.

        ``attention_mask`` is additive ``[B, 1, n, kv]``; ``cache`` a KVCache (or None in training).
        """
        x = self.fc(torch.cat([embeds, features], dim=-1))
        with attention_backends(x.device):
            out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                             use_cache=cache is not None, position_embeddings=self.rotary(x, position_ids))
        return out[0] if isinstance(out, tuple) else out


class EagleTokenStep:
    """EAGLE's one-token draft step (one ``(f_t, x_{t+1})`` pair per row) in few tensor operations.

    Draft steps run once per drafted token on a single position, so what they cost is the
    number of operations launched, not arithmetic: on an H100 the decoder layer called through
    transformers, with its mask and rotary setup, took 1.9 ms a step, about 30 us per
    operation, against 26 ms for the 135M target's whole step. This computes the same layer
    (:class:`EagleDraft`'s ``forward``) with one fused q/k/v product and one gate/up product, a
    precomputed rotary table, and no mask (a row's single query attends to every slot it has
    stored), writing into the same :class:`~specdraft.cache.KVCache`. All rows must be at the
    same length (a batch of one always is); :meth:`usable` says when it applies.
    """

    #: rotary types whose cos/sin depend on the position alone, so a table can hold them
    STATIC_ROPE = ("default", "linear", "llama3")

    def __init__(self, draft: "EagleDraft") -> None:
        layer, attn = draft.layer, draft.layer.self_attn
        cfg = draft.llama_config
        self.fc, self.o, self.down = draft.fc, attn.o_proj, layer.mlp.down_proj
        self.norm, self.act, self.rotary = layer.post_attention_layernorm, layer.mlp.act_fn, draft.rotary
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
        self.scaling = attn.scaling
        with torch.no_grad():
            self.qkv_weight, self.qkv_bias = _fused(attn.q_proj, attn.k_proj, attn.v_proj)
            self.gate_up_weight, self.gate_up_bias = _fused(layer.mlp.gate_proj, layer.mlp.up_proj)
        self._cos = self._sin = None  # [positions, head_dim]

    @classmethod
    def supports(cls, draft: "EagleDraft") -> bool:
        return (getattr(draft.rotary, "rope_type", None) in cls.STATIC_ROPE
                and isinstance(draft.layer.input_layernorm, nn.Identity))

    @staticmethod
    def usable(cache, batch: int) -> bool:
        """Whether the next step of ``cache`` (``batch`` rows) can take this path."""
        layer = cache.layers[0]
        lengths = cache.lengths
        return (bool(lengths) and all(n == lengths[0] for n in lengths) and layer.is_initialized
                and layer.keys.shape[0] == batch and layer.keys.shape[2] > lengths[0])

    def _rotary(self, position: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] <= position or self._cos.dtype != like.dtype \
                or self._cos.device != like.device:
            size = max(position + 1, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            cos, sin = self.rotary(like, torch.arange(size, device=like.device)[None])
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[position], self._sin[position]

    def __call__(self, features: torch.Tensor, embeds: torch.Tensor, cache) -> torch.Tensor:
        """``features`` (``f_t``), ``embeds`` (``embed(x_{t+1})``) ``# [B, H]`` -> ``f_{t+1}`` guesses ``# [B, H]``;
        the pair's key and value are stored at each row's next slot and the cache advances by one."""
        from ...fastpath import few_row_linear as linear

        batch, start = features.shape[0], cache.lengths[0]
        x = linear(torch.cat([embeds, features], dim=-1), self.fc.weight, self.fc.bias)  # [B, H]
        qkv = linear(x, self.qkv_weight, self.qkv_bias).view(batch, -1, self.head_dim)
        cos, sin = self._rotary(start, x)
        q_and_k = qkv[:, : self.heads + self.kv_heads]
        half = self.head_dim // 2
        q_and_k = q_and_k * cos + torch.cat([-q_and_k[..., half:], q_and_k[..., :half]], dim=-1) * sin
        layer = cache.layers[0]
        layer.keys[:, :, start] = q_and_k[:, self.heads :]
        layer.values[:, :, start] = qkv[:, self.heads + self.kv_heads :]
        with attention_backends(x.device):
            att = F.scaled_dot_product_attention(
                q_and_k[:, : self.heads, None], layer.keys[:, :, : start + 1], layer.values[:, :, : start + 1],
                scale=self.scaling, enable_gqa=self.heads != self.kv_heads)  # [B, heads, 1, head_dim]
        hidden = x + linear(att.reshape(batch, -1), self.o.weight, self.o.bias)
        gate, up = linear(self.norm(hidden), self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        cache.advance(1)
        return hidden + linear(self.act(gate) * up, self.down.weight, self.down.bias)


def _fused(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) computing several linear layers of the same input, outputs concatenated."""
    weight = torch.cat([m.weight for m in linears]).detach()
    if all(m.bias is None for m in linears):
        return weight, None
    return weight, torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=weight.dtype,
                                                                             device=weight.device)
                              for m in linears]).detach()


def causal_mask(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive causal mask ``[1, 1, n, n]`` for training over whole sequences."""
    mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask[None, None]


class MLPSpeculator(nn.Module):
    kind = "mlp-speculator"

    def __init__(self, hidden_size: int, num_stages: int) -> None:
        super().__init__()
        self.config = {"hidden_size": hidden_size, "num_stages": num_stages}
        self.state_proj = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_stages))
        self.token_proj = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_stages))
        self.norm = nn.ModuleList(nn.LayerNorm(hidden_size) for _ in range(num_stages))
        self.out = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_stages))
        # The IBM speculator's weighting keeps the state's variance constant across stages.
        self.state_weight = 0.5 ** (0.5 / num_stages)
        self.token_weight = math.sqrt(1 - self.state_weight**2)

    @property
    def num_stages(self) -> int:
        return len(self.out)

    def stage(self, i: int, state: torch.Tensor, token_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage ``i``: ``(state_{i-1}, embed(token_{i-1}))`` -> ``(state_i, feature_i)`` for the LM head."""
        mixed = self.state_proj[i](state) * self.state_weight + self.token_proj[i](token_embeds) * self.token_weight
        state = F.gelu(self.norm[i](mixed))
        return state, self.out[i](state)


def build_heads(kind: str, target_config: Any, **cfg) -> nn.Module:
    """A freshly initialised head module of ``kind`` shaped for ``target_config``."""
    hidden = target_config.hidden_size
    if kind == "medusa":
        return MedusaHeads(hidden, cfg.get("num_heads", 4), cfg.get("num_layers", 1))
    if kind == "eagle":
        return EagleDraft(eagle_layer_config(target_config, **cfg.get("layer", {})), cfg.get("fc_bias", True))
    if kind == "mlp-speculator":
        return MLPSpeculator(hidden, cfg.get("num_stages", 4))
    raise ValueError(f"unknown head kind {kind!r}; expected one of {', '.join(KINDS)}")
