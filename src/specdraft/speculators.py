"""A ``speculators`` checkpoint (vLLM / Red Hat) given as the model, as ``vllm serve CHECKPOINT``
takes it: the target is the checkpoint's verifier and the drafter is the checkpoint itself.

The checkpoint's ``config.json`` (see :mod:`specdraft.drafters.heads.published` for the rest of
the layout)::

    "speculators_model_type": "eagle3",
    "speculators_config": {"algorithm": "eagle3",
                           "default_proposal_method": "greedy",
                           "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, ...}],
                           "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", ...}}

reads as ``--target meta-llama/Llama-3.1-8B-Instruct --drafter eagle3 --drafter-option
heads=CHECKPOINT --spec-length 3`` (the default proposal method's ``speculative_tokens``, unless a
draft length is given). The checkpoint is a local folder, or a hub id whose ``config.json`` is in
the Hugging Face cache or can be fetched. Whatever cannot be honoured is one :class:`ConfigError`
line saying what to give instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError, ModelLoadError
from .limits import MAX_SPEC_LENGTH
from .speculative_config import API_NAMES, DrafterChoice

#: speculators' algorithm -> the drafter that runs its heads
ALGORITHMS = {"eagle3": "eagle3", "eagle": "eagle"}


@dataclass(frozen=True)
class Checkpoint:
    """A speculators checkpoint given as the model: where it is and what it asks for."""

    source: str  # as given: a folder or a hub id (the drafter's ``heads``)
    algorithm: str  # speculators' name ("eagle3", "eagle")
    drafter: str  # the specdraft drafter that runs it
    verifier: str  # the target: speculators_config.verifier.name_or_path
    spec_length: int | None  # the default proposal method's speculative_tokens (None: not given)

    def choose(self, drafter: Any = None, spec_length: int | None = None, drafter_options: Mapping | None = None,
               speculative_config: Any = None, names: tuple[str, ...] = API_NAMES) -> DrafterChoice:
        """The drafter this checkpoint is, with ``spec_length`` (None: the checkpoint's, else 4) and
        ``drafter_options`` added to its ``heads``; ConfigError for a ``speculative_config`` or a
        drafter or heads other than the checkpoint's (``names``: how the errors name the four
        arguments, as for :func:`~specdraft.speculative_config.choose_drafter`)."""
        instead = f"leave it out, or give the target {self.verifier!r} as the model with it"
        if speculative_config is not None:
            raise ConfigError(f"{names[0]}: the model {self.source!r} is a speculators checkpoint, which names the "
                              f"drafter ({self.drafter}, its own heads); {instead}", param="speculative_config")
        if drafter is not None and drafter != self.drafter:
            raise ConfigError(f"{names[1]} {drafter if isinstance(drafter, str) else type(drafter).__name__!r}: the "
                              f"model {self.source!r} is a speculators {self.algorithm} checkpoint, drafted by "
                              f"{self.drafter}; {instead}", param="drafter")
        options = dict(drafter_options or {})
        if options.setdefault("heads", self.source) != self.source:
            raise ConfigError(f"{names[3]} heads={options['heads']}: the model {self.source!r} is a speculators "
                              f"checkpoint, whose heads are its own; {instead}", param="drafter_options")
        length = spec_length if spec_length is not None else self.spec_length if self.spec_length is not None else 4
        return DrafterChoice(self.drafter, length, options)


def _config_file(model: str) -> Path | None:
    """``model``'s config.json: in its folder, or a hub id's (from the cache, or fetched as a target's
    files are); None when there is none to read (the target's own loading then says why)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path / "config.json" if (path / "config.json").is_file() else None
    from .drafters.heads.published import HUB_ID
    from .models import hub_folder

    if not HUB_ID.fullmatch(model) or model.endswith(".gguf"):
        return None

    try:
        folder = hub_folder(model, ["config.json"], what="config.json")
    except ModelLoadError:
        return None
    return folder / "config.json" if (folder / "config.json").is_file() else None


def _spec_length(where: str, spec: Mapping) -> int | None:
    """The default proposal method's ``speculative_tokens`` (None: none named)."""
    methods = [m for m in spec.get("proposal_methods") or () if isinstance(m, Mapping)]
    default = spec.get("default_proposal_method")
    method = next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else None)
    tokens = None if method is None else method.get("speculative_tokens")
    if tokens is None:
        return None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_SPEC_LENGTH:
        raise ConfigError(f"the speculators checkpoint {where!r} drafts speculative_tokens={tokens!r} tokens; specdraft "
                          f"drafts 1 to {MAX_SPEC_LENGTH}: give a draft length (--spec-length, spec_length=)",
                          param="spec_length")
    return tokens


def read_checkpoint(model: str | os.PathLike | None) -> Checkpoint | None:
    """``model`` as a speculators checkpoint (None: it is not one, or cannot be read here);
    ConfigError in one line for an algorithm specdraft does not run or a checkpoint that names no
    verifier."""
    if model is None:
        return None
    model = str(model)
    config_file = _config_file(model)
    if config_file is None:
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # not a checkpoint this can read; loading it as a target says what is wrong
    if not isinstance(config, dict) or not ("speculators_config" in config or "speculators_model_type" in config):
        return None
    spec = config.get("speculators_config") if isinstance(config.get("speculators_config"), Mapping) else {}
    algorithm = spec.get("algorithm") or config.get("speculators_model_type")
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"the speculators checkpoint {model!r} is of algorithm {algorithm!r}, which specdraft does "
                          f"not run; it runs {' and '.join(ALGORITHMS)} checkpoints (docs/coming-from-vllm.md)")
    verifier = spec.get("verifier") if isinstance(spec.get("verifier"), Mapping) else {}
    name = verifier.get("name_or_path")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"the speculators checkpoint {model!r} names no verifier (speculators_config.verifier."
                          f"name_or_path): give the target explicitly and the checkpoint as its drafter: --target "
                          f"TARGET --drafter {ALGORITHMS[algorithm]} --drafter-option heads={model}")
    return Checkpoint(model, algorithm, ALGORITHMS[algorithm], name, _spec_length(model, spec))


__all__ = ["ALGORITHMS", "Checkpoint", "read_checkpoint"]
