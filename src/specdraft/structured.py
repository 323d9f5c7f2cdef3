"""Structured output as users ask for it: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and ``guided_*`` fields and the CLI's flags, read into a
:class:`~specdraft.grammar.GrammarSpec` and compiled per decoder (:class:`Grammars`).

How the grammar keeps speculation exact: :mod:`specdraft.grammar` and :mod:`specdraft.engine.processors`.

``response_format`` (Python API, server, the CLI's ``--response-format FILE``)::

    {"type": "text"}                                  no constraint
    {"type": "json_object"}                           any JSON object
    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}, "strict": true}}
    {"type": "regex", "regex": "..."}                 specdraft's additions, vLLM's kinds
    {"type": "choice", "choice": ["...", ...]}
    {"type": "grammar", "grammar": "..."}             Lark, or GBNF (llama.cpp's, vLLM's EBNF)

(the Python API also takes the strings ``"json_object"`` and ``"text"``).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Mapping

from .grammar import INSTALL_HINT, GrammarCompiler, GrammarSpec, available
from .errors import ConfigError

#: response_format's types, and what each holds besides ``type``
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "choice", "grammar")
#: vLLM's ``structured_outputs`` keys (and ``guided_<key>`` fields) specdraft takes
VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: any JSON object (``{"type": "json_object"}``)
JSON_OBJECT = '{"type":"object"}'


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _keys(value: Mapping, allowed: tuple[str, ...], where: str) -> None:
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; it takes {', '.join(map(repr, allowed))}", param=where)


def _schema(value, where: str) -> str:
    """A JSON schema (an object, or its JSON text) as JSON text, its keys in their order (the
    order properties are generated in)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: not valid JSON: {exc}", param=where) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: a JSON schema must be an object, got {_type_name(value)}", param=where)
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: not a JSON schema: {exc}", param=where) from None


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {what} must be a non-empty string, got {_type_name(value)}", param=where)
    return value


def _choices(value, where: str) -> str:
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
        raise ConfigError(f"{where}: must be a non-empty list of non-empty strings", param=where)
    return json.dumps(list(value), ensure_ascii=False)


def guided(kind: str, value: Any, field: str) -> GrammarSpec | None:
    """vLLM's guided decoding of ``kind`` (one of :data:`VLLM_KINDS`) with ``value``, from the
    request field ``field`` (``guided_json``, ``structured_outputs.regex``, ...); None: unset."""
    if value is None:
        return None
    if kind == "json":
        return GrammarSpec("json_schema", _schema(value, field), field)
    if kind == "json_object":
        if not isinstance(value, bool):
            raise ConfigError(f"{field}: must be true or false, got {_type_name(value)}", param=field)
        return GrammarSpec("json_schema", JSON_OBJECT, field) if value else None
    if kind == "regex":
        return GrammarSpec("regex", _text(value, field, "a regular expression"), field)
    if kind == "choice":
        return GrammarSpec("choice", _choices(value, field), field)
    if kind == "grammar":
        return GrammarSpec("grammar", _text(value, field, "a grammar"), field)
    raise ConfigError(f"{field}: not supported by specdraft; use one of {', '.join(VLLM_KINDS)}", param=field)


def response_format(value: Any, field: str = "response_format") -> GrammarSpec | None:
    """``value`` (OpenAI's ``response_format``, see the module's docstring; a :class:`GrammarSpec`
    passes through) as the grammar it asks for; None: no constraint. ConfigError naming the
    part of ``field`` at fault."""
    if value is None or isinstance(value, GrammarSpec):
        return value
    if isinstance(value, str) and value in ("text", "json_object"):
        value = {"type": value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{field}: must be an object such as {{\"type\": \"json_object\"}} or {{\"type\": "
                          f"\"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}, got "
                          f"{_type_name(value)}", param=field)
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ConfigError(f"{field}.type: must be one of {', '.join(map(repr, RESPONSE_FORMAT_TYPES))}, got {kind!r}",
                          param=field)
    if kind in ("text", "json_object"):
        _keys(value, ("type",), field)
        return None if kind == "text" else GrammarSpec("json_schema", JSON_OBJECT, field)
    _keys(value, ("type", kind), field)
    if kind not in value:
        raise ConfigError(f"{field}.{kind}: required with type {kind!r}", param=field)
    inner, where = value[kind], f"{field}.{kind}"
    if kind != "json_schema":
        return guided(kind, inner, where)
    if not isinstance(inner, Mapping):
        raise ConfigError(f"{where}: must be an object {{\"name\": ..., \"schema\": {{...}}, \"strict\": ...}}, got "
                          f"{_type_name(inner)}", param=where)
    _keys(inner, ("name", "schema", "strict", "description"), where)
    if "schema" not in inner:
        raise ConfigError(f"{where}.schema: required (the JSON schema the output must match)", param=where)
    if inner.get("name") is not None and not isinstance(inner["name"], str):
        raise ConfigError(f"{where}.name: must be a string, got {_type_name(inner['name'])}", param=where)
    if inner.get("strict") is not None and not isinstance(inner["strict"], bool):
        raise ConfigError(f"{where}.strict: must be true or false, got {_type_name(inner['strict'])}", param=where)
    return GrammarSpec("json_schema", _schema(inner["schema"], f"{where}.schema"), field)


def structured_outputs(value: Any, field: str = "structured_outputs") -> GrammarSpec | None:
    """vLLM's ``structured_outputs`` object: exactly one of ``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{field}: must be an object with one of {', '.join(VLLM_KINDS)}, got {_type_name(value)}",
                          param=field)
    _keys(value, VLLM_KINDS, field)
    specs = [(k, guided(k, v, f"{field}.{k}")) for k, v in value.items() if v is not None]
    if len(specs) > 1:
        raise ConfigError(f"{field}: set one of {', '.join(VLLM_KINDS)}, not {' and '.join(k for k, _ in specs)}",
                          param=field)
    return specs[0][1] if specs else None


def one_of(specs: Mapping[str, GrammarSpec | None]) -> GrammarSpec | None:
    """The one grammar a request asks for, from its fields ``{field: spec or None}``; ConfigError
    naming the second field when two ask for one."""
    given = [(name, spec) for name, spec in specs.items() if spec is not None]
    if len(given) > 1:
        raise ConfigError(f"{given[1][0]}: cannot be combined with {given[0][0]}; ask for one grammar",
                          param=given[1][0])
    return given[0][1] if given else None


def from_cli(response_format_arg: str | None, json_schema_file: str | None, regex: str | None) -> GrammarSpec | None:
    """``specdraft generate``'s ``--response-format json_object|text|FILE.json``, ``--json-schema
    FILE`` and ``--regex R`` (at most one); ConfigError naming the flag."""
    given = [f for f, v in (("--response-format", response_format_arg), ("--json-schema", json_schema_file),
                            ("--regex", regex)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"{given[1]}: cannot be combined with {given[0]}; give one", param=given[1])
    if regex is not None:
        return GrammarSpec("regex", _text(regex, "--regex", "the regular expression"), "--regex")
    if json_schema_file is not None:
        return GrammarSpec("json_schema", _schema(_read_json(json_schema_file, "--json-schema"),
                                                  f"--json-schema {json_schema_file}"), "--json-schema")
    if response_format_arg is None:
        return None
    if response_format_arg in ("text", "json_object"):
        return response_format(response_format_arg, "--response-format")
    data = _read_json(response_format_arg, "--response-format")
    try:
        spec = response_format(data)
    except ConfigError as exc:
        raise ConfigError(f"--response-format {response_format_arg}: {exc}", param="--response-format") from None
    return None if spec is None else GrammarSpec(spec.kind, spec.source, "--response-format")


def _read_json(path: str, flag: str):
    """The JSON value in the file ``path``."""
    try:
        with open(path, "rb") as f:
            data = f.read(8 * 1024 * 1024 + 1)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc}); give json_object, text or "
                          "a JSON file", param=flag) from None
    if len(data) > 8 * 1024 * 1024:
        raise ConfigError(f"{flag} {path}: it is larger than 8 MiB; a schema is far smaller", param=flag)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{flag} {path}: not valid JSON: {exc}", param=flag) from None


class Grammars:
    """A decoder's structured output: its requests' grammars checked and compiled, with its
    tokenizer (the compiler, and llguidance's view of the tokenizer, are made at the first
    request that asks for a grammar; any thread may call)."""

    def __init__(self, tokenizer, target) -> None:
        self.tokenizer, self.target = tokenizer, target
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, value: Any, *, stop_token_ids=()):
        """The compiled grammar (:class:`~specdraft.grammar.Grammar`) a request's
        ``response_format`` (or a :class:`GrammarSpec`) asks for, None for none; ConfigError
        naming the field at fault, or saying what to install."""
        spec = response_format(value)
        if spec is None:
            return None
        if self.tokenizer is None:
            raise ConfigError(f"{spec.field}: structured output needs the model's tokenizer; this decoder has none",
                              param=spec.field)
        if not self.target.eos_token_ids and not stop_token_ids:
            raise ConfigError(f"{spec.field}: the model has no end-of-sequence token to end a complete output with; "
                              "give stop_token_ids", param=spec.field)
        if not available():
            raise ConfigError(f"{spec.field}: structured output needs the llguidance package, which is not "
                              f"installed: {INSTALL_HINT}", param=spec.field)
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.target.vocab_size, self.target.eos_token_ids)
        return self._compiler.compile(spec)


__all__ = ["Grammars", "GrammarSpec", "from_cli", "guided", "one_of", "response_format", "structured_outputs"]
