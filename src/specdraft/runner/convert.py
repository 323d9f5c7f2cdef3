"""Build a :class:`SpecdraftModel` from a loaded transformers model, or say why not.

``from_transformers(hf_model)`` reads the config, checks every feature the modules would need,
and moves the weights over: q/k/v and gate/up are concatenated into the fused ``wqkv`` and
``w13`` (new tensors); embeddings, norms and the other projections share transformers' tensors.
It returns ``(None, reason)`` for anything it does not reproduce exactly, so the caller can fall
back to transformers and say so in one line.
"""

from __future__ import annotations

import torch

from .model import ModelArgs, SpecdraftModel, rope_inv_freq

#: transformers architectures the modules reproduce (all Llama-shaped decoders)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def from_transformers(hf_model) -> tuple[SpecdraftModel | None, str]:
    """``(model, "")`` with the same weights, dtype and device, or ``(None, reason)``."""
    args, reason = model_args(hf_model)
    if args is None:
        return None, reason
    with torch.device("meta"):
        model = SpecdraftModel(args)
    head = hf_model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):  # e.g. a compact draft's head: used as it is
        model.output = head
    missing, unexpected = model.load_state_dict(_weights(hf_model, args), assign=True, strict=False)
    missing = [k for k in missing if not (k.startswith("output.") and model.output is head)]
    if missing or unexpected:  # a weight left on the meta device would fail far from here
        raise RuntimeError(f"converting {type(hf_model).__name__}: missing {missing}, unexpected {unexpected}")
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope_inv_freq = rope_inv_freq(args).to(hf_model.device)  # the meta one holds no values
    return model.requires_grad_(False).eval(), ""


def model_args(hf_model) -> tuple[ModelArgs | None, str]:
    """The :class:`ModelArgs` for ``hf_model``, or ``(None, reason)`` naming the unsupported feature."""
    name = type(hf_model).__name__
    if name not in ARCHITECTURES:
        return None, f"{name} is not a supported architecture (supported: {', '.join(ARCHITECTURES)})"
    config = hf_model.config
    if getattr(hf_model, "hf_quantizer", None) is not None or getattr(config, "quantization_config", None):
        return None, f"{name} has quantized weights, which specdraft's model code does not load"
    reason = placement_reason(name, list(hf_model.parameters()))
    if reason:
        return None, reason
    out, emb = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    tied = isinstance(emb, torch.nn.Embedding) and getattr(out, "weight", None) is emb.weight
    args, reason = config_args(name, config, vocab_size=config.vocab_size, n_layers=config.num_hidden_layers,
                               tie_embeddings=tied)
    if args is None:
        return None, reason
    if getattr(out, "bias", None) is not None:
        return None, f"{name} has a bias on its output head, not supported"
    if not isinstance(emb, torch.nn.Embedding):
        return None, f"{name} has an input embedding of type {type(emb).__name__}, not supported"
    return args, ""


def placement_reason(name: str, params: list[torch.Tensor]) -> str:
    """Why weights spread over several devices or dtypes (or left on the meta device) are refused, or ""."""
    if len({(p.device, p.dtype) for p in params}) != 1 or params[0].device.type == "meta":
        return f"{name} has weights on several devices or dtypes (offloaded or mixed), not supported"
    return ""


def config_args(arch: str, config, label: str | None = None, **fields) -> tuple[ModelArgs | None, str]:
    """The :class:`ModelArgs` that the decoder layers of architecture ``arch`` (one of
    :data:`ARCHITECTURES`) with ``config`` need, or ``(None, reason)`` naming ``label`` (default
    ``arch``). ``fields``: the rest (``vocab_size``, ``n_layers``, ``tie_embeddings``), which the
    layers do not read."""
    name = label or arch
    if config.hidden_act != "silu":
        return None, f"{name} uses hidden_act={config.hidden_act!r}; only 'silu' is supported"
    if arch != "Qwen2ForCausalLM" and getattr(config, "attention_bias", False):  # Qwen2: q/k/v bias, always
        return None, f"{name} has attention_bias=True, not supported"
    if getattr(config, "mlp_bias", False):
        return None, f"{name} has mlp_bias=True, not supported"
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        return None, f"{name} uses rope_type={rope_type!r}; only 'default' and 'llama3' are supported"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return None, f"{name} rotates part of each head (partial_rotary_factor), not supported"
    window, reason = _sliding_window(arch, config, name)
    if reason:
        return None, reason
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    llama3 = None
    if rope_type == "llama3":
        llama3 = (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                  rope["original_max_position_embeddings"])
    return ModelArgs(
        dim=config.hidden_size,
        n_heads=heads,
        n_kv_heads=config.num_key_value_heads or heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        norm_eps=config.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
        rope_llama3=llama3,
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=window,
        **fields,
    ), ""


def _sliding_window(arch: str, config, name: str) -> tuple[int | None, str]:
    """The window every layer uses (None: full attention), or a reason (naming ``name``) when layers differ."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if arch == "MistralForCausalLM" or window is None:
        return window, ""
    # Qwen2/Qwen3: a window only on the layers that layer_types marks as sliding
    sliding = [t == "sliding_attention" for t in layer_types or []]
    if all(sliding) and sliding:
        return window, ""
    if not any(sliding):
        return None, ""
    return None, f"{name} slides its attention window on some layers only (layer_types), not supported"


def _weights(hf_model, args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers' parameters under our names, q/k/v and gate/up concatenated."""
    base = hf_model.model
    weights = {"tok_embeddings.weight": base.embed_tokens.weight.detach(), "norm.weight": base.norm.weight.detach()}
    head = hf_model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear):  # any other head module is kept as it is
        weights["output.weight"] = head.weight.detach()
    for i, layer in enumerate(base.layers):
        weights.update({f"layers.{i}.{k}": v for k, v in block_weights(layer, args).items()})
    return weights


def block_weights(layer, args: ModelArgs) -> dict[str, torch.Tensor]:
    """One transformers decoder layer's parameters under a :class:`TransformerBlock`'s names:
    q/k/v and gate/up concatenated (new tensors), the others transformers' own (detached).
    A layer whose input norm has no weight (an ``nn.Identity``, as in EAGLE-1) gives no
    ``attention_norm.weight``."""
    attn, mlp = layer.self_attn, layer.mlp
    weights = {
        "ffn_norm.weight": layer.post_attention_layernorm.weight,
        "attention.wqkv.weight": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        "attention.wo.weight": attn.o_proj.weight,
        "feed_forward.w13.weight": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        "feed_forward.w2.weight": mlp.down_proj.weight,
    }
    norm = getattr(layer.input_layernorm, "weight", None)
    if norm is not None:
        weights["attention_norm.weight"] = norm
    if args.qkv_bias:
        weights["attention.wqkv.bias"] = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    if args.qk_norm:
        weights["attention.q_norm.weight"] = attn.q_norm.weight
        weights["attention.k_norm.weight"] = attn.k_norm.weight
    return {k: v.detach() for k, v in weights.items()}
