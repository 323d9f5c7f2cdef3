"""Other servers' speculative settings, read into specdraft's drafter, draft length and drafter
options (:class:`DrafterChoice`): vLLM's speculative configuration, one JSON object
(``--speculative-config``, or ``speculative_config=`` in the Python API) that names the
speculation method and its settings, and SGLang's flags (below).

=============================  ==========================================================
vLLM                           specdraft
=============================  ==========================================================
``method: "ngram"``            ``--drafter prompt-lookup`` (vLLM's n-gram method looks the
                               last tokens up in the prompt and output: prompt lookup)
``prompt_lookup_max`` / _min   ``--drafter-option max_ngram=`` / ``min_ngram=``
``method: "eagle"``, eagle3,   ``--drafter eagle`` (eagle3, medusa, mlp-speculator)
medusa, ``mlp_speculator``     ``--drafter-option heads=MODEL``
``method: "draft_model"``      ``--drafter draft-model --drafter-option model=MODEL``
``method: "suffix"``           ``--drafter suffix``; ``suffix_decoding_max_tree_depth`` ->
                               ``max_depth``, ``suffix_decoding_min_token_prob`` -> ``min_prob``
``num_speculative_tokens``     ``--spec-length``
``draft_tensor_parallel_size`` 1 only: a drafter runs unsharded on rank 0
=============================  ==========================================================

As in vLLM, a config with a ``model`` and no ``method`` takes the method from the model's name
(``eagle3``, ``eagle``, ``medusa``, ``mlp_speculator`` in it), else ``draft_model``. Any other
key, any other method and any value specdraft cannot honour is one :class:`ConfigError` naming
it; nothing is ignored.

SGLang's flags (:func:`read_sglang_flags`) read into the same :class:`DrafterChoice`:

==================================  =========================================================
SGLang                              specdraft
==================================  =========================================================
``--speculative-algorithm EAGLE``   ``--drafter eagle`` (EAGLE3: ``eagle3``; STANDALONE:
                                    ``draft-model``)
``--speculative-draft-model-path``  ``--drafter-option heads=`` (STANDALONE: ``model=``)
``--speculative-num-steps``         ``--spec-length``
``--speculative-eagle-topk K``      ``--drafter-option tree_width=K`` (K > 1; 1: a chain)
``--speculative-num-draft-tokens``  ``--drafter-option tree_budget=N-1`` (a tree; a chain
                                    verifies steps + 1)
==================================  =========================================================
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from .drafters.common.tree import MAX_TREE_BUDGET, MAX_TREE_WIDTH
from .errors import ConfigError
from .limits import MAX_SPEC_LENGTH

#: vLLM's method -> the specdraft drafter that does it
METHODS = {"ngram": "prompt-lookup", "eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa",
           "mlp_speculator": "mlp-speculator", "draft_model": "draft-model", "suffix": "suffix"}
#: the drafter option ``model`` goes to, for the methods that load one
MODEL_OPTION = {"eagle": "heads", "eagle3": "heads", "medusa": "heads", "mlp_speculator": "heads",
                "draft_model": "model"}
#: vLLM's keys that map to a drafter option, and the methods that take them
OPTION_KEYS = {"prompt_lookup_max": ("ngram", "max_ngram"), "prompt_lookup_min": ("ngram", "min_ngram"),
               "suffix_decoding_max_tree_depth": ("suffix", "max_depth"),
               "suffix_decoding_min_token_prob": ("suffix", "min_prob")}
KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", *OPTION_KEYS)
PARAM = "speculative_config"


@dataclass(frozen=True)
class DrafterChoice:
    """What a speculative config (or the ``--drafter`` flags) asks for."""

    drafter: str
    spec_length: int | None  # None: the default
    options: dict[str, Any] = field(default_factory=dict)


def _error(message: str, where: str = PARAM) -> ConfigError:
    return ConfigError(f"{where}: {message}", param=PARAM)


def _int(config: Mapping, key: str, low: int, high: int | None = None) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise _error(f"{key} must be an integer {bound}, got {value!r}")
    return value


def _method(config: Mapping) -> str:
    method, model = config.get("method"), config.get("model")
    if method is None:
        if not isinstance(model, str) or not model:
            raise _error(f"give a method ({', '.join(METHODS)}), or a model to take it from")
        name = model.lower()
        return next((m for m in ("eagle3", "eagle", "medusa", "mlp_speculator") if m in name), "draft_model")
    if method not in METHODS:
        raise _error(f"method {method!r} is not one specdraft has; it has {', '.join(METHODS)} (see "
                     "docs/coming-from-vllm.md)")
    return method


def read_speculative_config(value: str | Mapping[str, Any]) -> DrafterChoice:
    """``value`` (JSON text or a mapping, vLLM's keys) as the drafter it asks for; ConfigError
    (``param="speculative_config"``) naming the key at fault."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _error(f"not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise _error(f"must be a JSON object such as {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, "
                     f"got {type(value).__name__}")
    unknown = [k for k in value if k not in KEYS]
    if unknown:
        raise _error(f"unknown key {unknown[0]!r}: specdraft takes {', '.join(KEYS)}")
    method = _method(value)
    options: dict[str, Any] = {}
    model = value.get("model")
    if method in MODEL_OPTION:
        if not isinstance(model, str) or not model:
            raise _error(f"method {method!r} needs a model (a hub id or a folder), got {model!r}")
        options[MODEL_OPTION[method]] = model
    elif model is not None:
        raise _error(f"method {method!r} loads no model; leave model out")
    for key, (owner, option) in OPTION_KEYS.items():
        if value.get(key) is not None:
            if owner != method:
                raise _error(f"{key} is a setting of method {owner!r}, not of {method!r}")
            options[option] = value[key]
    tp = _int(value, "draft_tensor_parallel_size", 1)
    if tp not in (None, 1):
        raise _error(f"draft_tensor_parallel_size={tp}: specdraft runs a drafter unsharded on rank 0 "
                     "(docs/tensor-parallel.md); give 1 or leave it out")
    return DrafterChoice(METHODS[method], _int(value, "num_speculative_tokens", 1, MAX_SPEC_LENGTH), options)


#: the arguments' names in the Python API, and on the command line
API_NAMES = ("speculative_config", "drafter", "spec_length", "drafter_options")
CLI_NAMES = ("--speculative-config", "--drafter", "--spec-length", "--drafter-option")


def choose_drafter(drafter: Any = None, spec_length: int | None = None, drafter_options: Mapping | None = None,
                   speculative_config: str | Mapping | None = None, names: tuple[str, ...] = API_NAMES) -> DrafterChoice:
    """The drafter the arguments ask for: ``speculative_config``, or ``drafter`` (None: ngram),
    ``spec_length`` (None: 4) and ``drafter_options``; ConfigError when a config comes with any of
    those (``names``: how the errors name the four arguments)."""
    if speculative_config is None:
        return DrafterChoice("ngram" if drafter is None else drafter, 4 if spec_length is None else spec_length,
                             dict(drafter_options or {}))
    given = [name for name, v in zip(names[1:], (drafter, spec_length, drafter_options or None)) if v is not None]
    if given:
        raise _error(f"it names the drafter and its settings; give it or {given[0]}, not both", names[0])
    try:
        choice = read_speculative_config(speculative_config)
    except ConfigError as exc:
        raise ConfigError(names[0] + str(exc).removeprefix(PARAM), param=PARAM) from None
    return DrafterChoice(choice.drafter, 4 if choice.spec_length is None else choice.spec_length, choice.options)


# -- SGLang's flags -------------------------------------------------------------------------------

#: SGLang's flags that specdraft takes, by their argparse names
SGLANG_FLAGS = {"speculative_algorithm": "--speculative-algorithm",
                "speculative_draft_model_path": "--speculative-draft-model-path",
                "speculative_num_steps": "--speculative-num-steps",
                "speculative_eagle_topk": "--speculative-eagle-topk",
                "speculative_num_draft_tokens": "--speculative-num-draft-tokens"}
#: SGLang's algorithm -> the specdraft drafter that does it, and the option its draft model goes to
SGLANG_ALGORITHMS = {"EAGLE": ("eagle", "heads"), "EAGLE3": ("eagle3", "heads"),
                     "STANDALONE": ("draft-model", "model")}
#: SGLang's algorithms that have no twin here, and what to use instead
SGLANG_INSTEAD = {
    "NGRAM": "SGLang's n-gram cache of every request's recent tokens, searched breadth-first, has no twin here; use "
             "--drafter suffix (trees from this request's and earlier requests' tokens) or --drafter prompt-lookup "
             "(this request's own tokens)",
    "NEXTN": "specdraft does not run a model's own multi-token-prediction layers; use EAGLE or EAGLE3 heads",
    "MTP": "specdraft does not run a model's own multi-token-prediction layers; use EAGLE or EAGLE3 heads",
}


def read_sglang_flags(speculative_algorithm: str | None = None, speculative_draft_model_path: str | None = None,
                      speculative_num_steps: int | None = None, speculative_eagle_topk: int | None = None,
                      speculative_num_draft_tokens: int | None = None) -> DrafterChoice | None:
    """SGLang's speculative flags as the drafter they ask for (None: none given); ConfigError naming
    the flag at fault.

    ``--speculative-num-steps`` is the draft's depth (``--spec-length``); ``--speculative-eagle-topk``
    K > 1 drafts EAGLE-2's dynamic tree with K children per node (``tree_width``), of
    ``--speculative-num-draft-tokens`` N tokens verified with the last one (``tree_budget`` N - 1);
    topk 1 (the default) drafts a chain, where SGLang verifies steps + 1 tokens.
    """
    given = {name: value for name, value in locals().items() if value is not None}
    if not given:
        return None
    flag = SGLANG_FLAGS
    if speculative_algorithm is None:
        raise ConfigError(f"{flag[next(iter(given))]} needs --speculative-algorithm "
                          f"({', '.join(SGLANG_ALGORITHMS)})", param=PARAM)
    algorithm = speculative_algorithm.upper()
    if algorithm in SGLANG_INSTEAD:
        raise ConfigError(f"--speculative-algorithm {speculative_algorithm}: {SGLANG_INSTEAD[algorithm]}", param=PARAM)
    if algorithm not in SGLANG_ALGORITHMS:
        raise ConfigError(f"--speculative-algorithm {speculative_algorithm} is not one specdraft has; it has "
                          f"{', '.join(SGLANG_ALGORITHMS)} (docs/coming-from-vllm.md)", param=PARAM)
    drafter, option = SGLANG_ALGORITHMS[algorithm]
    if not speculative_draft_model_path:
        raise ConfigError(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path (the "
                          f"{'draft model' if option == 'model' else 'heads'}: a folder or a hub id)", param=PARAM)
    checked = {}
    for name, high in (("speculative_num_steps", MAX_SPEC_LENGTH), ("speculative_eagle_topk", MAX_TREE_WIDTH),
                       ("speculative_num_draft_tokens", MAX_TREE_BUDGET + 1)):
        value = given.get(name)
        if value is not None and not 1 <= value <= high:
            raise ConfigError(f"{flag[name]} must be from 1 to {high}, got {value}", param=PARAM)
        checked[name] = value
    steps, topk, tokens = checked.values()
    options: dict[str, Any] = {option: speculative_draft_model_path}
    if topk is not None and topk > 1:
        if tokens is None:
            raise ConfigError(f"--speculative-eagle-topk {topk} drafts a tree: give its size with "
                              "--speculative-num-draft-tokens (the tokens each round verifies)", param=PARAM)
        if tokens < 2:
            raise ConfigError(f"--speculative-num-draft-tokens {tokens}: a tree verifies the last token and at "
                              "least one drafted; give 2 or more", param=PARAM)
        options.update(tree_width=topk, tree_budget=tokens - 1)
    elif tokens is not None and tokens != (steps or 4) + 1:
        raise ConfigError(f"--speculative-num-draft-tokens {tokens}: a chain (--speculative-eagle-topk 1) of "
                          f"{steps or 4} steps verifies {(steps or 4) + 1} tokens; give that, leave it out, or give "
                          "--speculative-eagle-topk > 1 for a tree", param=PARAM)
    return DrafterChoice(drafter, steps, options)


__all__ = ["DrafterChoice", "METHODS", "SGLANG_FLAGS", "choose_drafter", "read_sglang_flags",
           "read_speculative_config"]
