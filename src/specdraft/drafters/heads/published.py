"""Heads other projects publish, beyond Medusa and EAGLE-1 (see :mod:`.formats`): EAGLE-3
folders, the ``speculators`` format, and Hugging Face hub ids for any of them.

EAGLE-3, as the EAGLE repository saves it (``yuhuili/EAGLE3-*``; SGLang, SpecForge and ModelOpt
write the same)::

    config.json    a one-layer Llama config plus "draft_vocab_size" (architectures
                   ["LlamaForCausalLMEagle3"]); optional "target_hidden_size",
                   "norm_before_residual", "eagle_aux_hidden_state_layer_ids" (top level, or in
                   "eagle_config" with ModelOpt's switches)
    pytorch_model.bin or model.safetensors (or shards and their index)
                   fc.weight [H, 3 * H_target] (no bias); midlayer.{input_layernorm, hidden_norm,
                   post_attention_layernorm}.weight; midlayer.self_attn.{q,k,v}_proj.weight
                   [*, 2H] and o_proj.weight; midlayer.mlp.{gate,up,down}_proj.weight;
                   norm.weight; lm_head.weight [draft_vocab, H]; d2t [draft_vocab] (target id =
                   i + d2t[i]; absent: identity, a full-vocabulary head); t2d (dropped);
                   embed_tokens.weight (ignored: the target's embeddings are used)

``speculators`` (vLLM / Red Hat), ``config.json`` with "speculators_model_type" ("eagle3" or
"eagle"), "transformer_layer_config" (a Llama config from ``to_diff_dict``: defaults left out),
"speculators_config" ({"algorithm", "proposal_methods", "default_proposal_method",
"verifier": {"name_or_path", "architectures"}}) and ``model.safetensors``:

* eagle3 ("draft_vocab_size", "norm_before_residual", "target_hidden_size",
  "eagle_aux_hidden_state_layer_ids"): the EAGLE-3 weights above with ``layers.0.*`` for
  ``midlayer.*``;
* eagle ("layernorms", "fusion_bias", "transformer_layer_architecture"): ``fusion_fc.weight``
  (+ ``.bias``) and ``transformer.*``, a LlamaDecoderLayer without its input norm: EAGLE-1's.

Target layers are read as vLLM reads them: id ``i`` is the residual stream entering target block
``i`` (transformers' ``hidden_states[i]``); unnamed, ``(2, L // 2, L - 3)``. ``fc`` reads them
in ascending layer order, the order vLLM and SGLang collect them in whatever order the config
lists them. (SGLang adds one to ids a config names; specdraft follows vLLM, whose format the
ids come from.)

Every refusal is one :class:`ConfigError` line naming what differs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..api import ConfigError, ModelLoadError, TargetInfo
from ..common.weights import load_strict, load_weights
from .modules import Eagle3Draft, EagleDraft, eagle3_default_layers, eagle_layer_config

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
#: what a hub id's download is restricted to (no READMEs, images or training states)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.pt"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
#: norms some EAGLE-1 variants add around the layer (speculators' "layernorms"; the TTT recipe of
#: speculators' research/hass), which EAGLE-1's head does not have
EXTRA_NORMS = ("embed_layernorm.weight", "hidden_layernorm.weight", "lm_head_layernorm.weight",
               "post_embedding_layernorm.weight", "embedding_layernorm.weight", "pre_lm_head_layernorm.weight")
DROPPED = ("embed_tokens.weight", "t2d")


# -- finding the files ------------------------------------------------------------------------

def resolve_heads(given: str, target: TargetInfo) -> Path:
    """The folder ``heads=given`` names: a local folder, else a Hugging Face hub id fetched (or
    found in the cache, offline) as a target's is."""
    path = Path(given).expanduser()
    if path.is_dir():
        return path
    if not HUB_ID.fullmatch(given):
        raise ConfigError(f"heads folder {given!r} does not exist; pass --drafter-option heads=DIR (made by "
                          "`specdraft train-heads`, or a Medusa / EAGLE / EAGLE-3 / speculators checkpoint folder) "
                          "or a Hugging Face hub id such as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    try:
        return Path(target.services.hub_folder(given, HUB_PATTERNS, what="heads"))
    except ModelLoadError as exc:
        raise ConfigError(f"{exc} (no folder {given!r} exists here either)") from None


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); fix or replace that file") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a {type(value).__name__}, not a JSON object")
    return value


def weights_files(path: Path) -> list[Path]:
    """A published folder's weights: its one file, or the shards its index names ([] if none)."""
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    for name in INDEX_FILES:
        if (path / name).is_file():
            shards = sorted(set(read_json(path / name).get("weight_map", {}).values()))
            missing = [s for s in shards if not (path / s).is_file()]
            if missing or not shards:
                raise ConfigError(f"{path / name} names weight files that are not in {path}: {missing[:3]}")
            return [path / s for s in shards]
    return []


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = weights_files(path)
    if not files:
        raise ConfigError(f"{path} has config.json but no weights ({' or '.join(WEIGHT_FILES)})")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_weights(f))
    return raw


def _weight_names(path: Path) -> set[str] | None:
    """The tensor names of a folder's safetensors weights, read without loading them (None: a
    PyTorch file, which would have to be loaded)."""
    files = weights_files(path)
    if not files or any(f.suffix != ".safetensors" for f in files):
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        try:
            with safe_open(f, framework="pt") as opened:
                names.update(opened.keys())
        except Exception:  # noqa: BLE001 - a damaged file: the loader names it
            return None
    return names


def detect_published(path: Path, config: dict) -> str | None:
    """``"speculators"``, ``"eagle3"`` or None (perhaps EAGLE-1: :mod:`.formats` decides)."""
    if "speculators_model_type" in config or "speculators_config" in config:
        return "speculators"
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    if (set(config.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES) or "draft_vocab_size" in config
            or "eagle_aux_hidden_state_layer_ids" in config or "eagle_aux_hidden_state_layer_ids" in nested):
        return "eagle3"
    names = _weight_names(path)
    if names and any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    return None


# -- checks shared by the layouts ---------------------------------------------------------------

def _name(target: TargetInfo) -> str:
    return repr(target.name or "target")


def _trained_for(base: str) -> str:
    """``base``: the model the heads say they were trained for ("": unknown)."""
    return f"they were trained for {base!r} (their verifier)" if base else "they were trained for another model"


def check_width(found: int, target: TargetInfo, where: Path, what: str, base: str = "") -> None:
    if target.hidden_size and found != target.hidden_size:
        raise ConfigError(f"the heads in {where} {what} of width {found}, but target {_name(target)} has "
                          f"{target.hidden_size}: {_trained_for(base)}")


def check_vocab(found: int | None, target: TargetInfo, where: Path, what: str, base: str = "") -> None:
    """Refuse heads made for a vocabulary of ``found`` tokens (None: unknown) when the target's differs
    (``base``: the model the heads name as theirs, for the message)."""
    sizes = {target.vocab_size, getattr(target.config, "vocab_size", None)}
    if found is not None and target.vocab_size and int(found) not in sizes:
        raise ConfigError(f"the heads in {where} are for a vocabulary of {int(found)} tokens ({what}), but target "
                          f"{_name(target)} has {target.vocab_size}: {_trained_for(base)}")


def _target_layers(target: TargetInfo) -> int | None:
    config = target.config
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "num_hidden_layers", None)


def _layer_config(fields: dict, where: Path, what: str):
    """The one-layer LlamaConfig of a published head (missing fields: transformers' defaults, as
    the checkpoint's own code reads them; never the target's)."""
    try:
        return eagle_layer_config(fields)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"the {what} of {where} is not a Llama config transformers accepts: {exc}") from None


def _layer_ids(raw: dict, *prefixes: str) -> set[int]:
    """The decoder layers the weights hold under ``{prefix}{i}.``."""
    found = set()
    for key in raw:
        for prefix in prefixes:
            if key.startswith(prefix) and key[len(prefix):].split(".", 1)[0].isdigit():
                found.add(int(key[len(prefix):].split(".", 1)[0]))
    return found


def _one_layer(count: int, where: Path, kind: str) -> None:
    if count > 1:
        raise ConfigError(f"the {kind} head in {where} has {count} decoder layers; specdraft runs {kind} heads of "
                          "one layer (as the EAGLE repository publishes them)")


def check_eagle_weights(raw: dict, config: dict, target: TargetInfo, where: Path) -> None:
    """Refusals for an EAGLE-1/2 (or HASS) folder: several layers, extra norms, another vocabulary.
    The layers are counted in the weights (some folders carry their base model's whole config)."""
    _one_layer(max(_layer_ids(raw, "layers.") | {0}) + 1, where, "EAGLE")
    extra = sorted(k for k in raw if k in EXTRA_NORMS)
    if extra:
        raise ConfigError(f"the EAGLE head in {where} has extra norms ({', '.join(extra)}: speculators' "
                          "\"layernorms\" variant), which EAGLE-1's head has not; not supported")
    check_vocab(config.get("vocab_size"), target, where, "config.json vocab_size")
    if "embed_tokens.weight" in raw:
        check_vocab(raw["embed_tokens.weight"].shape[0], target, where, "its copy of the embeddings")


# -- EAGLE-3 --------------------------------------------------------------------------------------

def _refuse_eagle_config(nested: dict, where: Path) -> None:
    """ModelOpt's / vLLM's ``eagle_config`` switches that change the head's structure."""
    different = {"use_aux_hidden_state": False, "use_input_layernorm_in_first_layer": False,
                 "use_last_layernorm": False, "use_mtp_layernorm": True}
    for key, bad in different.items():
        if key in nested and bool(nested[key]) == bad:
            raise ConfigError(f"the EAGLE-3 head in {where} sets eagle_config.{key}={str(bad).lower()}, a variant "
                              "specdraft's EAGLE-3 layer does not reproduce; not supported")
    if int(nested.get("parallel_draft_step") or 1) > 1:
        raise ConfigError(f"the EAGLE-3 head in {where} drafts several tokens per step "
                          "(eagle_config.parallel_draft_step > 1); not supported")


def _eagle3(where: Path, target: TargetInfo, fields: dict, raw: dict, *, aux, target_hidden: int | None,
            draft_vocab: int | None, norm_before_residual: bool, layer_prefixes: tuple[str, ...], fmt: str,
            base: str = "", what: str = "config.json"):
    """Build and load :class:`Eagle3Draft` from a published EAGLE-3 head's config ``fields`` (its
    layer's) and weights ``raw``, the layer's weights under ``layer_prefixes``."""

    cfg = _layer_config(fields, where, what)
    hidden = cfg.hidden_size
    target_hidden = int(target_hidden or hidden)
    check_width(hidden, target, where, "embed tokens", base)
    check_width(target_hidden, target, where, "read target states", base)
    # (a transformer_layer_config leaves transformers' defaults out: there a missing vocab_size is 32000)
    check_vocab(fields.get("vocab_size", cfg.vocab_size if what != "config.json" else None), target, where,
                f"{what} vocab_size", base)
    if "t2d" in raw:
        check_vocab(raw["t2d"].numel(), target, where, "the length of t2d", base)
    if "fc.weight" not in raw:
        raise ConfigError(f"{where} has no fc.weight: it is not an EAGLE-3 head")
    if "fc.bias" in raw:
        raise ConfigError(f"the EAGLE-3 head in {where} has an fc bias (SGLang's \"bias\": true); the EAGLE "
                          "repository's and vLLM's EAGLE-3 have none; not supported")
    if "input_norm.weight" in raw:
        raise ConfigError(f"the EAGLE-3 head in {where} normalises its input before fc (speculators' "
                          "norm_before_fc); not supported")
    if aux is None:
        n_layers = _target_layers(target)
        if n_layers is None:
            raise ConfigError(f"the EAGLE-3 head in {where} names no target layers (eagle_aux_hidden_state_layer_ids) "
                              "and the target's layer count is unknown")
        aux = eagle3_default_layers(n_layers)
    if not isinstance(aux, (list, tuple)) or not aux or not all(isinstance(i, int) for i in aux):
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids of {where} is {aux!r}, not a list of layer ids")
    aux = tuple(sorted(aux))  # fc reads them in layer order, as vLLM and SGLang collect them
    width = raw["fc.weight"].shape[1]
    if width != len(aux) * target_hidden:
        raise ConfigError(f"fc.weight of the EAGLE-3 head in {where} reads {width} values, but {len(aux)} target "
                          f"layers {list(aux)} of width {target_hidden} give {len(aux) * target_hidden}")
    if "lm_head.weight" in raw:
        draft_vocab = draft_vocab or raw["lm_head.weight"].shape[0]
    else:
        draft_vocab = draft_vocab or cfg.vocab_size
        if fields.get("tie_word_embeddings"):
            raise ConfigError(f"the EAGLE-3 head in {where} ties its LM head to its embeddings "
                              "(tie_word_embeddings) and has no lm_head.weight; not supported")
        usable = target.lm_head is not None and getattr(target.lm_head, "bias", None) is None
        if draft_vocab != target.vocab_size or not usable:
            raise ConfigError(f"the EAGLE-3 head in {where} has no lm_head.weight, and its draft vocabulary "
                              f"({draft_vocab} tokens) is not the target's ({target.vocab_size}) whose LM head "
                              "could stand in for it")
        raw = {**raw, "lm_head.weight": target.lm_head.weight.detach()}  # the target's, as a copy
    module = Eagle3Draft(cfg, aux, target_hidden, int(draft_vocab), norm_before_residual)
    state = {"d2t": module.d2t}  # absent: identity, draft entry i is target token i
    for key, value in raw.items():
        prefix = next((p for p in layer_prefixes if key.startswith(p)), None)
        if prefix is not None:
            state["midlayer." + key[len(prefix):]] = value
        elif key not in DROPPED:
            state[key] = value  # fc, norm, lm_head, d2t; anything else is reported by the strict load
    load_strict(module, state, where)
    meta = {"kind": "eagle3", "format": fmt, "config": module.config, "target": base}
    return "eagle3", module, None, meta


def load_eagle3_folder(path: Path, target: TargetInfo, config: dict | None = None,
                       raw: dict[str, torch.Tensor] | None = None):
    """An EAGLE-3 folder as the EAGLE repository saves it (see the module's docstring)."""
    config = read_json(path / "config.json") if config is None else config
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    _refuse_eagle_config(nested, path)
    raw = read_weights(path) if raw is None else raw
    layers = max(_layer_ids(raw, "layers.", "midlayers.") | {0}) + 1
    _one_layer(max(layers, int(config.get("num_hidden_layers") or 1)), path, "EAGLE-3")
    aux = config.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    return _eagle3(path, target, config, raw, aux=aux, target_hidden=config.get("target_hidden_size"),
                   draft_vocab=config.get("draft_vocab_size"),
                   norm_before_residual=bool(config.get("norm_before_residual", False)),
                   layer_prefixes=("midlayer.", "layers.0."), fmt="eagle3")


# -- speculators --------------------------------------------------------------------------------

def load_speculators(path: Path, target: TargetInfo, config: dict | None = None):
    """A ``speculators`` folder, EAGLE-3 or EAGLE (see the module's docstring)."""
    config = read_json(path / "config.json") if config is None else config
    kind = config.get("speculators_model_type")
    if kind not in ("eagle3", "eagle"):
        raise ConfigError(f"{path} holds a speculators model of type {kind!r}; specdraft loads 'eagle3' and 'eagle'")
    fields = config.get("transformer_layer_config")
    if not isinstance(fields, dict):
        raise ConfigError(f"the speculators config of {path} has no transformer_layer_config object")
    if fields.get("model_type", "llama") != "llama":
        raise ConfigError(f"the speculators {kind} head in {path} has a {fields['model_type']!r} layer "
                          "(transformer_layer_config.model_type); specdraft runs Llama layers")
    base = (((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")) or ""
    raw = read_weights(path)
    what = "transformer_layer_config"
    if kind == "eagle3":
        if config.get("norm_before_fc"):
            raise ConfigError(f"the EAGLE-3 head in {path} normalises its input before fc (norm_before_fc); "
                              "not supported")
        _one_layer(max(_layer_ids(raw, "layers.") | {0}) + 1, path, "EAGLE-3")
        # vLLM reads a speculators config without "norm_before_residual" as true
        return _eagle3(path, target, fields, raw, aux=config.get("eagle_aux_hidden_state_layer_ids"),
                       target_hidden=config.get("target_hidden_size"), draft_vocab=config.get("draft_vocab_size"),
                       norm_before_residual=bool(config.get("norm_before_residual", True)),
                       layer_prefixes=("layers.0.",), fmt="speculators", base=base, what=what)
    return _speculators_eagle(path, target, config, fields, raw, base)


def _speculators_eagle(path: Path, target: TargetInfo, config: dict, fields: dict, raw: dict, base: str):

    if config.get("layernorms"):
        raise ConfigError(f"the speculators EAGLE head in {path} sets layernorms=true (norms on the embeddings, "
                          "the layer's input and before the LM head), which EAGLE-1's head has not; not supported")
    arch = config.get("transformer_layer_architecture", "LlamaDecoderLayer")
    if arch != "LlamaDecoderLayer":
        raise ConfigError(f"the speculators EAGLE head in {path} has a {arch} layer "
                          "(transformer_layer_architecture); specdraft runs LlamaDecoderLayer")
    if "fusion_fc.weight" not in raw:
        raise ConfigError(f"{path} has no fusion_fc.weight: it is not a speculators EAGLE head")
    bias = "fusion_fc.bias" in raw
    said = bool(config.get("fusion_bias", False))
    if said != bias:
        raise ConfigError(f"the speculators EAGLE head in {path} says fusion_bias={str(said).lower()} but its weights "
                          f"{'have' if bias else 'lack'} fusion_fc.bias; the checkpoint is inconsistent")
    cfg = _layer_config(fields, path, "transformer_layer_config")
    check_width(cfg.hidden_size, target, path, "read hidden states", base)
    check_vocab(cfg.vocab_size, target, path, "transformer_layer_config vocab_size", base)
    module = EagleDraft(cfg, fc_bias=bias)
    state = {}
    for key, value in raw.items():
        if key.startswith("fusion_fc."):
            state["fc." + key[len("fusion_fc."):]] = value
        elif key.startswith("transformer."):
            state["layer." + key[len("transformer."):]] = value
        elif key not in ("embed_tokens.weight", "lm_head.weight"):  # the verifier's, when saved at all
            state[key] = value  # reported by the strict load
    load_strict(module, state, path)
    return "eagle", module, None, {"kind": "eagle", "format": "speculators", "config": module.config, "target": base}


__all__ = ["HUB_PATTERNS", "check_eagle_weights", "detect_published", "load_eagle3_folder", "load_speculators",
           "read_json", "read_weights", "resolve_heads", "weights_files"]
