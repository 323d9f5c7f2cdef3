"""What a request asks for: :class:`GenerationSettings`, one frozen object checked once.

The Python API (``SpeculativeDecoder.generate(prompts, settings)`` and the stream variants, or
their keyword form, which builds one), the CLI and the server all build a
:class:`GenerationSettings`; the engine's :class:`~specdraft.engine.sequence.Sequence` holds a
reference to it. A bad value raises one :class:`~specdraft.errors.ConfigError` with the setting
at fault as ``param``. Checks that need the model (token ids against its vocabulary) are
:meth:`GenerationSettings.check_ids`, which the decoder runs when a request is submitted.

Adding a setting: a field here (its default, its check in ``__post_init__``), then its use
(the engine, or the decoder for settings that change the prompt); the server passes a request
body's fields of the same name through (:meth:`specdraft.server.protocol.SamplingRequest.settings`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

from pydantic import ValidationError

from .errors import ConfigError
from .sampling import SamplingParams
from .types import LOGPROBS_MODES, MAX_CHOICES, MAX_LOGPROBS

#: Seeds are 64-bit (torch.Generator.manual_seed).
MAX_SEED = 2**64 - 1
#: the most a logit_bias entry may add or take away (OpenAI's range)
MAX_LOGIT_BIAS = 100.0
#: Bounds on what makes one request costly for every other in its batch (each checked at every
#: committed token or round): stop strings and their length (OpenAI allows 4; 10,000 strings of
#: 100 characters took 12-52 s for 32 tokens), and logit_bias entries (OpenAI allows 300).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000
MAX_LOGIT_BIAS_ENTRIES = 1024


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_id(value) -> int | None:
    """``value`` as a token id if it is an integer (Python, numpy or a one-element torch tensor), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


@dataclass(frozen=True, kw_only=True)
class GenerationSettings:
    """One request's settings (vLLM's ``SamplingParams``), checked when made; frozen (derive
    another with :meth:`replace`).

    The sampling pipeline's (:class:`~specdraft.SamplingParams`, as ``.sampling``):
    ``temperature`` (0: greedy), ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
    ``presence_penalty``, ``frequency_penalty``.

    - ``max_new_tokens``: the most tokens to generate; ``min_tokens``: the first this many are
      never EOS or a stop token (their probability 0 in the target's distribution) and stop
      strings do not end generation before them.
    - ``stop``: strings that end the output (not included in the text); ``stop_token_ids``:
      tokens that end it as EOS does; ``ignore_eos``: keep generating past EOS.
    - ``seed``: reproducible sampling (each prompt and choice its own numbers; None: random).
    - ``n``: choices per prompt (the prompt prefilled once).
    - ``logprobs``: the most likely tokens to report at each output position (0-20; 0: the
      output token's own only; None: none), ``logprobs_mode``: ``"processed"`` or ``"raw"``.
    - ``logit_bias``: ``{token id: bias}``, -100 to 100, added to the logits before the pipeline.
    - ``response_format``: structured output (see :mod:`specdraft.structured`); kept as its
      :class:`~specdraft.grammar.GrammarSpec`.
    - ``prediction``: the output's expected text or token ids (Predicted Outputs); n=1 only.
    - ``truncate_prompt_tokens``: keep only the prompt's last this many tokens (vLLM's; None: all).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: Any = ()
    stop_token_ids: Any = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    logprobs_mode: str = "processed"
    logit_bias: Any = None
    response_format: Any = None
    prediction: Any = None
    truncate_prompt_tokens: int | None = None
    #: the sampling pipeline's part (derived)
    sampling: SamplingParams = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise ConfigError(f"n must be an integer from 1 to {MAX_CHOICES} (choices per prompt), got {self.n!r}",
                              param="n")
        self._set("sampling", _sampling(self))
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1 (got {self.max_new_tokens!r})",
                              param="max_new_tokens")
        seed = self.seed
        if seed is not None and (not is_int(seed) or not 0 <= seed <= MAX_SEED):
            raise ConfigError(f"seed must be an integer from 0 to 2**64 - 1, or None (got {seed!r})", param="seed")
        self._set("stop", _stops(self.stop))
        self._check_stop_settings()
        self._check_logprobs()
        self._set("logit_bias", _bias_entries(self.logit_bias))
        self._set("prediction", _prediction(self.prediction))
        if self.n > 1 and self.prediction is not None:
            raise ConfigError("prediction works with n=1 only: its acceptance counts are a request's, not a choice's",
                              param="prediction")
        if self.response_format is not None:
            self._set("response_format", _grammar_spec(self.response_format, self.ignore_eos))
        cut = self.truncate_prompt_tokens
        if cut is not None and (not is_int(cut) or cut < 1):
            raise ConfigError(f"truncate_prompt_tokens must be an integer >= 1 (the prompt's last tokens to keep), "
                              f"or None to keep it whole (got {cut!r})", param="truncate_prompt_tokens")

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def replace(self, **changes) -> "GenerationSettings":
        """A copy with ``changes`` (setting names to values), checked again."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, settings: "GenerationSettings | None" = None, **options) -> "GenerationSettings":
        """``settings`` (None: the defaults) with ``options`` (settings by name) changed: the keyword
        form of the API; an unknown name is a ConfigError naming the settings there are."""
        unknown = sorted(set(options) - set(SETTING_NAMES))
        if unknown:
            raise ConfigError(f"unknown setting {unknown[0]!r}; the settings are {', '.join(SETTING_NAMES)}",
                              param=unknown[0])
        if settings is None:
            return cls(**options)
        if not isinstance(settings, GenerationSettings):
            raise ConfigError(f"settings must be a GenerationSettings (or None), got {type(settings).__name__}",
                              param="settings")
        return settings.replace(**options) if options else settings

    def _check_stop_settings(self) -> None:
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be True or False (got {self.ignore_eos!r})", param="ignore_eos")
        most, least = self.max_new_tokens, self.min_tokens
        if not is_int(least) or least < 0 or least > most:
            raise ConfigError(f"min_tokens must be an integer from 0 to max_new_tokens ({most}) (got {least!r})",
                              param="min_tokens")
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
            raise ConfigError(f"stop_token_ids must be a list of token ids (ints), got {type(ids).__name__}",
                              param="stop_token_ids")
        ids = list(ids)
        for value in ids:
            if token_id(value) is None:
                raise ConfigError(f"stop_token_ids holds {value!r} ({type(value).__name__}); token ids must be "
                                  "integers", param="stop_token_ids")
        self._set("stop_token_ids", tuple(sorted({token_id(v) for v in ids})))

    def _check_logprobs(self) -> None:
        logprobs = self.logprobs
        if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ConfigError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens to report "
                              f"at each position; 0: the output token's own only), or None for none (got {logprobs!r})",
                              param="logprobs")
        mode = self.logprobs_mode
        if not isinstance(mode, str) or mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode must be one of {', '.join(map(repr, LOGPROBS_MODES))} (got "
                              f"{mode!r}): 'processed' after the sampling settings, 'raw' the model's own",
                              param="logprobs_mode")

    def check_ids(self, vocab_size: int | None = None) -> None:
        """The token ids the settings hold (``stop_token_ids``, ``logit_bias``'s keys) in the
        vocabulary ``[0, vocab_size)`` (None: unknown, ids >= 0), and the biases in range; ConfigError."""
        for token in self.stop_token_ids:
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ConfigError(f"stop_token_ids holds {token}, outside the vocabulary [0, {vocab_size})"
                                  if vocab_size is not None else f"stop_token_ids holds {token}; token ids are >= 0",
                                  param="stop_token_ids")
        for token, bias in (self.logit_bias or {}).items():
            key = token_id(token)
            if key is None or key < 0 or (vocab_size is not None and key >= vocab_size):
                raise ConfigError(f"logit_bias has the key {token!r}; keys must be token ids from 0 to "
                                  f"{'the vocabulary size - 1' if vocab_size is None else vocab_size - 1}",
                                  param="logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                    or abs(bias) > MAX_LOGIT_BIAS:
                raise ConfigError(f"logit_bias[{token!r}] is {bias!r}; a bias must be a number from -100 to 100",
                                  param="logit_bias")

    @functools.cached_property
    def token_bias(self) -> "dict[int, float] | None":
        """``logit_bias`` as token ids to floats (checked by :meth:`check_ids`); None when empty."""
        return {token_id(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None


#: the settings by name (the keyword form's names)
SETTING_NAMES = tuple(f.name for f in dataclasses.fields(GenerationSettings) if f.init)


def _sampling(settings: GenerationSettings) -> SamplingParams:
    try:
        return SamplingParams(**{name: getattr(settings, name) for name in SamplingParams.model_fields})
    except ValidationError as exc:
        from .errors import describe_validation_error

        loc = exc.errors()[0]["loc"]
        raise ConfigError(f"invalid sampling settings: {describe_validation_error(exc)}",
                          param=str(loc[0]) if loc else None) from None


def _stops(stop) -> tuple[str, ...]:
    if stop is not None and not isinstance(stop, (str, list, tuple)):
        raise ConfigError(f"stop must be a string or a list of strings (got {type(stop).__name__} {stop!r})",
                          param="stop")
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise ConfigError(f"stop strings must be non-empty strings (got {stops!r})", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ConfigError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are served", param="stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ConfigError(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are served",
                          param="stop")
    return tuple(stops)


def _bias_entries(logit_bias) -> "dict | None":
    """A copy of ``logit_bias`` (None when empty); its entries are checked by ``check_ids``."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, Mapping):
        raise ConfigError(f"logit_bias must be a mapping of token ids to numbers, got {type(logit_bias).__name__}",
                          param="logit_bias")
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ConfigError(f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are served",
                          param="logit_bias")
    return dict(logit_bias) or None


def _prediction(prediction) -> "str | tuple[int, ...] | None":
    """A predicted output: text, or token ids (as a tuple); None (or empty): none."""
    if prediction is None or isinstance(prediction, str):
        from .verifier.prediction import check_prediction

        return check_prediction(prediction)
    if isinstance(prediction, (bytes, dict)) or not hasattr(prediction, "__iter__"):
        raise ConfigError(f"prediction must be text (a string) or token ids, got {type(prediction).__name__}",
                          param="prediction")
    ids = list(prediction)
    converted = [token_id(t) for t in ids]
    if None in converted:
        bad = ids[converted.index(None)]
        raise ConfigError(f"prediction holds {bad!r} ({type(bad).__name__}); token ids must be integers",
                          param="prediction")
    return tuple(converted) or None


def _grammar_spec(response_format, ignore_eos: bool):
    from .structured import response_format as read

    spec = read(response_format)
    if spec is not None and ignore_eos:
        raise ConfigError(f"ignore_eos cannot be combined with {spec.field}: the grammar ends the output with "
                          "end-of-sequence once it is complete; leave ignore_eos out", param="ignore_eos")
    return spec


def check_prompts(prompts) -> list[str]:
    """Text prompts as a list of non-empty, encodable strings, or ConfigError."""
    if prompts is None or isinstance(prompts, (bytes, bytearray)):
        raise ConfigError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}"
                          + ("; decode bytes first (prompt.decode('utf-8'))" if prompts is not None else ""),
                          param="prompt")
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not texts:
        raise ConfigError("no prompts given", param="prompt")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ConfigError(f"prompt {i} must be a string, got {type(text).__name__}", param="prompt")
        if not text.strip():
            raise ConfigError(f"prompt {i} is empty; give some text to continue", param="prompt")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"prompt {i} is not valid text: {exc.reason} at character {exc.start} "
                              f"({text[exc.start:exc.end]!r}); pass valid Unicode (UTF-8) text",
                              param="prompt") from None
    return texts


def check_token_ids(ids, what: str, vocab_size: int, max_context: int, param: str = "prompt",
                    keep_last: int | None = None) -> list[int]:
    """``ids`` (any iterable of integers) as a list, checked against the vocabulary, then cut to its
    last ``keep_last`` (None: all) and checked against the context."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ConfigError(f"{what} must be a list of token ids (ints), got {type(ids).__name__}", param=param)
    ids = list(ids)  # any iterable of ids, read once
    converted = [token_id(t) for t in ids]
    if None in converted:
        bad = ids[converted.index(None)]
        raise ConfigError(f"{what} holds {bad!r} ({type(bad).__name__}); token ids must be integers", param=param)
    if converted and (min(converted) < 0 or max(converted) >= vocab_size):
        raise ConfigError(f"{what} has token ids outside [0, {vocab_size})", param=param)
    if keep_last is not None:
        converted = converted[-keep_last:]
    if len(converted) >= max_context:
        raise ConfigError(f"{what} has {len(converted)} tokens but the model's context holds {max_context}; "
                          f"shorten it to at most {max_context - 1} tokens", param=param)
    return converted


__all__ = ["GenerationSettings", "MAX_LOGIT_BIAS", "MAX_SEED", "SETTING_NAMES", "check_prompts", "check_token_ids"]
