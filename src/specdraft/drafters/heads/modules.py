"""The three head architectures, as plain ``nn.Module``s that read the target's hidden states.

Notation: ``f_t`` is the target's last-layer hidden state at position ``t`` (after its final
norm, what its LM head reads); ``x_t`` the token at position ``t``. The target itself
turns ``f_t`` into ``x_{t+1}``; heads guess further ahead.

* :class:`MedusaHeads` (Medusa-1): head ``i`` (1-based) is ``i`` residual SiLU blocks on
  ``f_t`` followed by an LM head and guesses ``x_{t+i+1}``; the heads run in parallel.
* :class:`EagleDraft` (EAGLE-1): one decoder layer over ``fc([embed(x_{t+1}) ; f_t])``
  predicts ``f_{t+1}``, autoregressively at the feature level; the target's LM head turns
  predicted features into tokens. Training runs the transformers layer over whole sequences;
  drafting runs it on specdraft's own block over a KV cache
  (``TargetInfo.services.layer_runner``).
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

KINDS = ("medusa", "eagle", "eagle3", "mlp-speculator")


class SharedHead(nn.Module):
    """The target's LM head, over all tokens or only ``head_ids`` (a frequency-trimmed vocabulary).

    The weight rows are taken from the target at load time and never saved or trained; only
    ``head_ids`` is part of the heads' state. ``forward`` gives full-vocabulary logits with
    the most negative float outside ``head_ids`` (probability exactly 0 after softmax);
    ``small`` gives the logits of ``head_ids`` only, for training.
    """

    def __init__(self, lm_head: nn.Module, vocab_size: int, head_ids: torch.Tensor | None = None,
                 norm: nn.Module | None = None, own_rows: bool = False) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        weight = lm_head.weight.detach()
        self.register_buffer("head_ids", None if head_ids is None else head_ids.long().to(weight.device))
        # own_rows (EAGLE-3): ``lm_head`` is the heads' own, one row per entry of head_ids already
        rows = weight if head_ids is None or own_rows else weight[self.head_ids]
        self.register_buffer("weight", rows, persistent=False)  # [N, hidden]
        self.bias = getattr(lm_head, "bias", None)
        if self.bias is not None and head_ids is not None and not own_rows:
            self.bias = self.bias[self.head_ids]
        #: a norm applied before the rows (EAGLE-3's own final norm), or None
        self.norm = norm
        #: the rows' product for drafting (``TargetInfo.services.fast_linear``), or None: ``F.linear``.
        #: An instance attribute: a module assigned later is registered as a submodule, which a class
        #: attribute of the same name would hide (it did: drafting ran ``F.linear`` for months)
        self.product = None

    def small(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.product is not None:
            return self.product(hidden)
        return F.linear(hidden, self.weight, self.bias)  # [..., N]

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
        from ..common.copy_gate import column_table

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

    def fc_in(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The layer's input: ``fc([embed(x_{t+1}) ; f_t])``.  # [..., H]"""
        return self.fc(torch.cat([embeds, features], dim=-1))

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, past_key_values=None) -> torch.Tensor:
        """``features`` (``f_t``) and ``embeds`` (``embed(x_{t+1})``) ``# [B, n, H]`` -> ``f_{t+1}`` guesses ``# [B, n, H]``.

        One pass over whole sequences, no cache (training, and the reference that drafting, which
        runs :attr:`layer` on specdraft's own block over a KV cache, equals): ``attention_mask``
        is additive ``[B, 1, n, n]``. ``past_key_values`` (training's unrolled passes): the keys
        and values of earlier pairs, which these ``n`` also attend to (the mask is then
        ``[B, 1, n, earlier + n]``), extended with theirs.
        """
        from ..api import default_services  # training: no target, so specdraft's own attention rules

        x = self.fc_in(features, embeds)
        with default_services().attention_backends(x.device):
            out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids,
                             position_embeddings=self.rotary(x, position_ids), past_key_values=past_key_values)
        return out[0] if isinstance(out, tuple) else out


def eagle3_default_layers(n: int) -> tuple[int, int, int]:
    """EAGLE-3's feature layers for a target of ``n`` layers when a checkpoint's config does not
    name them (``eagle_aux_hidden_state_layer_ids``): ``(2, n // 2, n - 3)``, as vLLM, SGLang and
    the EAGLE repository choose them, each clamped into ``0..n-1`` (targets of under 6 layers),
    in layer order."""
    return tuple(sorted(min(max(i, 0), n - 1) for i in (2, n // 2, n - 3)))


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (the published ``midlayer``): attention reads
    ``[input_layernorm(embed(x)) ; hidden_norm(h)]`` (width ``2H``), the residual is ``h``
    (``hidden_norm(h)`` with ``norm_before_residual``, as the speculators format may say).
    Names follow the published checkpoints, so their weights load as they are."""

    def __init__(self, config, norm_before_residual: bool = False) -> None:
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        super().__init__()
        hidden = config.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        bias = bool(getattr(config, "attention_bias", False))
        for name in ("q_proj", "k_proj", "v_proj"):  # q, k and v read both halves
            setattr(self.self_attn, name, nn.Linear(2 * hidden, getattr(self.self_attn, name).out_features, bias=bias))
        self.mlp = LlamaMLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, attention_mask,
                past_key_values=None) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, n, 2H]
        h = residual + self.self_attn(x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                      past_key_values=past_key_values)[0]
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """EAGLE-3: ``fc`` fuses the target's states at three layers (``aux_layers``) into one
    feature ``g_t``; one :class:`Eagle3Layer` over ``(embed(x_{t+1}), g_t)`` gives the next
    feature, which is fed back as the next step's ``g`` (so drafting runs on its own features, as
    training-time test trains it to); the heads' own ``norm`` and ``lm_head`` over a draft
    vocabulary of ``draft_vocab`` tokens give logits, entry ``i`` being target token
    ``i + d2t[i]``. Everything but the target's embeddings is the heads' own.
    """

    kind = "eagle3"

    def __init__(self, config, aux_layers, target_hidden: int | None = None, draft_vocab: int | None = None,
                 norm_before_residual: bool = False) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        self.llama_config = config
        hidden = config.hidden_size
        target_hidden = target_hidden or hidden
        draft_vocab = draft_vocab or config.vocab_size
        self.aux_layers = tuple(int(i) for i in aux_layers)
        self.config = {"hidden_size": hidden, "target_hidden_size": target_hidden, "aux_layers": list(self.aux_layers),
                       "draft_vocab_size": draft_vocab, "norm_before_residual": norm_before_residual,
                       "layer": layer_fields(config)}
        self.fc = nn.Linear(len(self.aux_layers) * target_hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config, norm_before_residual)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))  # target id = i + d2t[i]
        self.rotary = LlamaRotaryEmbedding(config)

    def head_ids(self) -> torch.Tensor:
        """The target id of each draft-vocabulary entry.  # [draft_vocab]"""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the layer's outputs.  # [..., draft_vocab]"""
        return self.lm_head(self.norm(out))

    def draft_head(self, vocab_size: int) -> SharedHead:
        """Its own norm and LM head as a :class:`SharedHead` over the target's ``vocab_size``
        tokens (what drafting, the copy gate and the held-out check read)."""
        return SharedHead(self.lm_head, vocab_size, self.head_ids(), norm=self.norm, own_rows=True)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, past_key_values=None) -> torch.Tensor:
        """``features`` (fused ``g_t``, or the layer's own previous outputs) and ``embeds``
        (``embed(x_{t+1})``) ``# [B, n, H]`` -> the next features ``# [B, n, H]`` (before ``norm``).

        One pass over whole sequences, no cache (training, and the reference drafting equals),
        with an additive ``attention_mask # [B, 1, n, n]`` (and ``past_key_values``), as
        :meth:`EagleDraft.forward`."""
        from ..api import default_services

        with default_services().attention_backends(features.device):
            return self.midlayer(embeds, features, self.rotary(features, position_ids), attention_mask,
                                 past_key_values=past_key_values)


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
    if kind == "eagle3":
        aux = cfg.get("aux_layers") or eagle3_default_layers(target_config.num_hidden_layers)
        vocab = cfg.get("draft_vocab_size") or target_config.vocab_size
        return Eagle3Draft(eagle_layer_config(target_config, **cfg.get("layer", {})), aux,
                           cfg.get("target_hidden_size") or hidden, vocab, cfg.get("norm_before_residual", False))
    raise ValueError(f"unknown head kind {kind!r}; expected one of {', '.join(KINDS)}")
