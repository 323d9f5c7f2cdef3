"""Saving and loading heads: specdraft's own format and the published Medusa and EAGLE layouts.

specdraft's format (a folder)::

    specdraft_heads.json   {"format": "specdraft-heads/1", "kind": ..., "target": name,
                            "target_fingerprint": ..., "config": {...}, ...training facts}
    heads.safetensors      the head module's weights (+ ``head_ids`` when the vocabulary
                           is trimmed, + ``copy_gate.*`` when the heads have a copy gate,
                           described under "copy_gate" in the JSON); never the target's
                           embeddings or LM head

Published layouts users already have:

* Medusa: ``config.json`` with ``medusa_num_heads`` / ``medusa_num_layers`` and
  ``medusa_lm_head.safetensors`` (or ``.pt``) holding ``{i}.{j}.linear.{weight,bias}``
  for each head ``i``'s blocks ``j`` and ``{i}.{num_layers}.weight``, the head's own LM head.
* EAGLE(-1): ``config.json`` (a one-layer Llama config) and ``model.safetensors`` (or
  ``pytorch_model.bin``) holding ``fc.{weight,bias}`` and ``layers.0.*``; an
  ``embed_tokens.weight`` copy of the base model's embeddings is ignored (the target's is used).
  HASS saves the same (with an ``fc.bias``); heads of several layers, or with the extra norms of
  speculators' "layernorms" variant, are refused.
* EAGLE-3 folders, the ``speculators`` format and hub ids: :mod:`.published`.

These carry no fingerprint of their base model, so they are checked by shape only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..api import ConfigError, TargetInfo, write_atomic
from ..common.copy_gate import STATE_PREFIX, CopyGate
from ..common.weights import load_strict, load_weights
from .modules import KINDS, EagleDraft, MedusaHeads, SharedHead, build_heads, eagle_layer_config

FORMAT_FILE = "specdraft_heads.json"
FORMAT = "specdraft-heads/1"
WEIGHTS_FILE = "heads.safetensors"


def save_heads(module: torch.nn.Module, shared: SharedHead, path: str | Path, target_name: str, fingerprint: str,
               dtype=torch.bfloat16, extra: dict | None = None) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # a copy gate's few weights stay in float32 (its logit adds terms of very different sizes)
    state = {k: v.to(torch.float32 if k.startswith(STATE_PREFIX) else dtype) if v.is_floating_point() else v
             for k, v in module.state_dict().items()}
    if shared.head_ids is not None and module.kind != "eagle3":  # EAGLE-3's vocabulary is its d2t buffer
        state["head_ids"] = shared.head_ids
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    write_atomic(path / WEIGHTS_FILE, lambda tmp: save_file(tensors, tmp))
    meta = {"format": FORMAT, "kind": module.kind, "target": target_name, "target_fingerprint": fingerprint,
            "config": module.config, "head_tokens": None if shared.head_ids is None else int(shared.head_ids.numel()),
            **(extra or {})}
    gate = getattr(module, "copy_gate", None)
    if gate is not None:
        meta["copy_gate"] = {**gate.spec(), **meta.get("copy_gate", {})}
    write_atomic(path / FORMAT_FILE, json.dumps(meta, indent=1))  # last: it marks the folder complete
    return path


def detect_format(path: Path) -> str:
    if (path / FORMAT_FILE).is_file():
        return "specdraft"
    if any((path / f"medusa_lm_head.{ext}").is_file() for ext in ("safetensors", "pt")):
        return "medusa"
    from .published import detect_published, read_json, weights_files

    if (path / "config.json").is_file():
        found = detect_published(path, read_json(path / "config.json"))  # EAGLE-3, speculators
        if found is not None:
            return found
        if weights_files(path):
            return "eagle"
    elif weights_files(path):
        raise ConfigError(f"{path} has weights but no config.json (an accelerate training state, such as EAGLE's "
                          "or HASS's state_N folders?): put the config.json the head was trained with next to them")
    raise ConfigError(
        f"{path} holds no heads specdraft can read: expected {FORMAT_FILE} (specdraft's format, from "
        "`specdraft train-heads`), medusa_lm_head.safetensors + config.json (Medusa) or config.json + "
        "model.safetensors / pytorch_model.bin (EAGLE, HASS, EAGLE-3, speculators)"
    )


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_weights(path)  # one line for a corrupt file or a pickle torch refuses


def _check_width(found: int, target: TargetInfo, where: Path, what: str) -> None:
    if target.hidden_size and found != target.hidden_size:
        raise ConfigError(
            f"the heads in {where} read hidden states of width {found}, but target {target.name!r} has "
            f"{target.hidden_size}: they were trained for another model ({what}). Train heads for this target "
            "with `specdraft train-heads`"
        )


def _load_specdraft(path: Path, target: TargetInfo):
    from ..common.compact_draft import target_fingerprint

    meta = json.loads((path / FORMAT_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is in format {meta.get('format')!r}; this specdraft reads {FORMAT!r}")
    if target.embeddings is not None:
        fingerprint = target_fingerprint(target.embeddings.weight)
        if meta.get("target_fingerprint") != fingerprint:
            raise ConfigError(
                f"the {meta.get('kind')} heads in {path} were trained for target {meta.get('target')!r} "
                f"(fingerprint {meta.get('target_fingerprint')}), not for {target.name!r} (fingerprint {fingerprint}); "
                f"train heads for this target with `specdraft train-heads --kind {meta.get('kind')}`"
            )
    state = load_weights(path / WEIGHTS_FILE)
    head_ids = state.pop("head_ids", None)
    _check_width(int(meta["config"]["hidden_size"]), target, path, f"target {meta.get('target')!r}")
    module = build_heads(meta["kind"], target.config, **meta["config"])
    if "copy_gate" in meta:
        module.copy_gate = CopyGate.from_spec(meta["copy_gate"], int(meta["config"]["hidden_size"]))
    load_strict(module, state, path / WEIGHTS_FILE)
    return meta["kind"], module, head_ids, meta


def _load_medusa(path: Path, target: TargetInfo):
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    weights = next(path / f"medusa_lm_head.{e}" for e in ("safetensors", "pt") if (path / f"medusa_lm_head.{e}").is_file())
    raw = _read_weights(weights)
    num_heads = config.get("medusa_num_heads") or 1 + max(int(k.split(".")[0]) for k in raw)
    num_layers = config.get("medusa_num_layers")
    if num_layers is None:
        num_layers = max(int(k.split(".")[1]) for k in raw if k.endswith(".weight") and ".linear." not in k)
    hidden = raw["0.0.linear.weight"].shape[1] if "0.0.linear.weight" in raw else raw[f"0.{num_layers}.weight"].shape[1]
    _check_width(hidden, target, path, f"base model {config.get('base_model_name_or_path', 'unknown')!r}")
    module = MedusaHeads(hidden, num_heads, num_layers)
    vocab = raw[f"0.{num_layers}.weight"].shape[0] if f"0.{num_layers}.weight" in raw else None
    if vocab is not None:
        if vocab != target.vocab_size:
            raise ConfigError(f"the Medusa heads in {path} predict {vocab} tokens but the target has {target.vocab_size}")
        module.own_heads = torch.nn.ModuleList(torch.nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))
    state = {}
    for key, value in raw.items():
        head, index, rest = key.split(".", 2)
        if int(index) < num_layers:
            state[f"blocks.{head}.{index}.{rest}"] = value
        else:
            state[f"own_heads.{head}.{rest}"] = value
    load_strict(module, state, weights)
    meta = {"kind": "medusa", "format": "medusa", "config": module.config,
            "target": config.get("base_model_name_or_path", "")}
    return "medusa", module, None, meta


def _load_eagle(path: Path, target: TargetInfo):
    from .published import check_eagle_weights, load_eagle3_folder, read_json, read_weights

    config = read_json(path / "config.json")
    weights = path  # the folder: its one weights file or its shards
    raw = read_weights(path)
    if any(k.startswith("midlayer.") for k in raw):  # EAGLE-3 whose config did not say so
        return load_eagle3_folder(path, target, config, raw)
    check_eagle_weights(raw, config, target, path)  # several layers, extra norms, another vocabulary
    if "fc.weight" not in raw:
        raise ConfigError(f"{weights} has no fc.weight: it is not an EAGLE draft head")
    hidden = raw["fc.weight"].shape[0]
    _check_width(hidden, target, path, f"EAGLE config with hidden_size {config.get('hidden_size')}")
    fields = {k: v for k, v in config.items() if k not in ("architectures", "num_hidden_layers", "torch_dtype", "bias")}
    module = EagleDraft(eagle_layer_config(fields), fc_bias="fc.bias" in raw)
    state = {}
    for key, value in raw.items():
        if key.startswith("layers.0."):
            if key.startswith("layers.0.input_layernorm."):
                continue  # EAGLE-1 skips the first layer's input norm; some checkpoints still carry it
            state["layer." + key[len("layers.0."):]] = value
        elif key.startswith("fc."):
            state[key] = value
        elif not key.startswith("embed_tokens.") and not key.startswith("layers."):
            state[key] = value  # unknown: reported by the strict load
    load_strict(module, state, weights)
    return "eagle", module, None, {"kind": "eagle", "format": "eagle", "config": module.config, "target": ""}


def check_eagle3(module, target: TargetInfo, where: Path) -> None:
    """One line for EAGLE-3 heads that cannot serve ``target``: layers it lacks, a draft vocabulary
    mapping outside its vocabulary or onto one token twice, another hidden size."""
    n_layers = getattr(target.config, "num_hidden_layers", None) if target.config is not None else None
    if n_layers is not None and any(not 0 <= i < n_layers for i in module.aux_layers):
        raise ConfigError(f"the EAGLE-3 heads in {where} read target layers {list(module.aux_layers)}, but target "
                          f"{target.name or 'target'!r} has {n_layers} layers (0..{n_layers - 1}): they were trained "
                          "for another model")
    ids = module.head_ids()
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < target.vocab_size:
        raise ConfigError(f"the EAGLE-3 heads in {where} map their draft vocabulary to target ids up to "
                          f"{int(ids.max())}, but target {target.name or 'target'!r} has {target.vocab_size} tokens: "
                          "they were trained for another model")
    if ids.unique().numel() != ids.numel():
        raise ConfigError(f"the EAGLE-3 heads in {where} map two draft tokens to one target token (d2t is damaged)")
    width = int(module.config["target_hidden_size"])
    if target.hidden_size and (width != target.hidden_size or module.config["hidden_size"] != target.hidden_size):
        raise ConfigError(f"the EAGLE-3 heads in {where} read target states of width {width} (and embeddings of "
                          f"width {module.config['hidden_size']}), but target {target.name or 'target'!r} has "
                          f"{target.hidden_size}: they were trained for another model")


def load_heads(path: str | Path, target: TargetInfo, kind: str, dtype: Any = None, device: Any = None):
    """Load heads of ``kind`` from ``path`` (any supported format) for ``target``.

    Returns ``(module, shared_head, meta)``, on the target's device and dtype unless given.
    """
    from .published import load_eagle3_folder, load_speculators, resolve_heads

    path = resolve_heads(str(path), target)  # a folder, or a hub id's folder in the Hugging Face cache
    fmt = detect_format(path)
    loaders = {"specdraft": _load_specdraft, "medusa": _load_medusa, "eagle": _load_eagle,
               "eagle3": load_eagle3_folder, "speculators": load_speculators}
    found, module, head_ids, meta = loaders[fmt](path, target)
    if found != kind:
        raise ConfigError(f"{path} holds {found} heads, not {kind}; use --drafter {found}")
    if target.lm_head is None:
        raise ConfigError("heads share the target's LM head; load them through a SpeculativeDecoder")
    if head_ids is not None and head_ids.numel() and not 0 <= int(head_ids.min()) <= int(head_ids.max()) < target.vocab_size:
        raise ConfigError(f"the {kind} heads in {path} predict token ids up to {int(head_ids.max())} but target "
                          f"{target.name or 'target'!r} has {target.vocab_size}: they were trained for another model")
    dtype = dtype or target.dtype
    device = device or target.device
    module = module.to(dtype=dtype, device=device).eval()
    if kind == "eagle3":  # its own norm and LM head, over its draft vocabulary
        check_eagle3(module, target, path)
        shared = module.draft_head(target.vocab_size)
    else:
        shared = SharedHead(target.lm_head, target.vocab_size, head_ids).to(dtype=dtype, device=device)
    return module, shared, meta


__all__ = ["FORMAT", "FORMAT_FILE", "KINDS", "detect_format", "load_heads", "save_heads"]
