"""Tool calling: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` read into a
:class:`ToolRequest`, the grammar that forces a call, and the parsers that read calls out of an
output, whole or streamed (:class:`ToolStream`).

How each ``tool_choice`` decodes (the tools are shown to the model by its chat template in every case)::

    "none"       the answer is text
    "auto"       the model answers freely; the parser of its format reads calls out of the text:
                   hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen, Hermes, SmolLM3)
                   llama3_json  {"name": ..., "parameters": {...}}, ";"-separated (Llama 3.1-3.3)
    "required"   a grammar allows only a JSON array of calls of the given functions,
                 [{"name": ..., "parameters": {...}}, ...] (one call with parallel_tool_calls false)
    {"type": "function", "function": {"name": F}}
                 a grammar allows only F's arguments (its ``parameters`` JSON schema)

A forced call's JSON is written with json.dumps's separators (``", "``, ``": "``) and no other
whitespace (:data:`CALL_JSON`).

A grammar sets the target's probability of every token it forbids to 0 before speculation's
acceptance test (:mod:`specdraft.grammar`), so a forced call is exactly plain decoding's under it.
A call's ``arguments`` are JSON text: the output itself for a named function, the parsed
``arguments`` (``parameters``) object written back (``json.dumps``, as vLLM does) otherwise. A
streamed answer's deltas, joined, equal the whole answer's message (both come from one
:class:`ToolStream`). With ``parallel_tool_calls`` false, calls after the first are not reported.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .errors import ConfigError
from .grammar import GrammarSpec

CHOICES = ("none", "auto", "required")
#: the ``auto`` parsers, by ``--tool-call-parser`` name
PARSERS = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
#: how a forced call's JSON is written (llguidance's options): ``{"key": value, ...}``, json.dumps's
#: separators and no other whitespace, as models write calls
CALL_JSON = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
#: a function's name, as OpenAI allows it (and ``.``, as vLLM does)
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: a function's ``parameters`` when it has none
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


@dataclass(frozen=True)
class Function:
    """One of the request's tools: a function's name, description and ``parameters`` JSON schema."""

    name: str
    parameters: dict
    description: str | None = None

    def as_tool(self) -> dict:
        """OpenAI's tool object, as chat templates read it (``tools``)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


def _function(tool: Any, where: str) -> Function:
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise ConfigError(f"{where}: a tool must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                          f"\"parameters\": {{...}}}}}}", param=where)
    extra = sorted(set(tool) - {"type", "function"})
    if extra:
        raise ConfigError(f"{where}.{extra[0]}: unknown key; a tool takes type and function", param=f"{where}.{extra[0]}")
    fn, at = tool["function"], f"{where}.function"
    extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if extra:
        raise ConfigError(f"{at}.{extra[0]}: unknown key; a function takes name, description, parameters and strict",
                          param=f"{at}.{extra[0]}")
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ConfigError(f"{at}.name: must be 1 to 64 letters (a-z, A-Z), digits, '_', '-' or '.', got {name!r}",
                          param=f"{at}.name")
    parameters = fn.get("parameters", NO_PARAMETERS)
    where = f"{at}.parameters"
    if not isinstance(parameters, Mapping):
        raise ConfigError(f"{where}: must be a JSON schema object, got {_type_name(parameters)}", param=where)
    try:
        json.dumps(parameters, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: not a JSON schema: {exc}", param=where) from None
    if parameters.get("type", "object") != "object":
        raise ConfigError(f"{where}: a function's arguments are a JSON object: give \"type\": \"object\" (or leave "
                          f"type out), got {parameters['type']!r}", param=where)
    parameters = {**parameters, "type": "object"}
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ConfigError(f"{at}.description: must be a string, got {_type_name(description)}",
                          param=f"{at}.description")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise ConfigError(f"{at}.strict: must be true or false, got {_type_name(fn['strict'])}", param=f"{at}.strict")
    return Function(name, dict(parameters), description)


@dataclass(frozen=True)
class ToolRequest:
    """What a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask for
    (:func:`read_tools`); ``choice`` is none, auto, required, or the name of the function to call."""

    functions: tuple[Function, ...]
    choice: str
    parallel: bool = True
    named: bool = False  # choice names a function

    def template_tools(self) -> list[dict]:
        return [f.as_tool() for f in self.functions]

    def grammar(self) -> GrammarSpec | None:
        """The grammar that forces the call (``required`` or a named function); None otherwise."""
        if self.named:
            schema = _call_json(next(f.parameters for f in self.functions if f.name == self.choice))
            return GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False), "tools")
        if self.choice != "required":
            return None
        # each function's schema under $defs, its own "#..." references moved along with it
        defs = {f"tool_{i}": _rebase(f.parameters, f"#/$defs/tool_{i}") for i, f in enumerate(self.functions)}
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f.name]},
                                                   "parameters": {"$ref": f"#/$defs/tool_{i}"}},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for i, f in enumerate(self.functions)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "$defs": defs}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec("json_schema", json.dumps(_call_json(schema), ensure_ascii=False), "tools")

    def apply(self, settings):
        """``settings`` (a :class:`~specdraft.GenerationSettings`) with the grammar that forces the
        call; ConfigError when they already ask for structured output another way."""
        grammar = self.grammar()
        if self.choice == "none":
            return settings
        if settings.response_format is not None:
            raise ConfigError(f"response_format: not with tool_choice {self.choice!r} (the answer may be a call, "
                              "not your format); use tool_choice 'none', or leave response_format out",
                              param="response_format")
        return settings if grammar is None else settings.replace(response_format=grammar)

    def stream(self, parser: str | None) -> "ToolStream":
        """A :class:`ToolStream` of one choice's output; ``parser`` reads ``auto``'s calls (one of
        :data:`PARSERS`; None: the model has none, a ConfigError)."""
        if self.named:
            return ToolStream(_NamedCall(self.choice), 1)
        if self.choice == "required":
            return ToolStream(_CallArray(), None if self.parallel else 1)
        if self.choice == "none":
            return ToolStream(_Text(), 0)
        return ToolStream(auto_parser(parser), None if self.parallel else 1)


def _call_json(schema: dict) -> dict:
    """``schema`` with :data:`CALL_JSON`'s options (a schema's own ``x-guidance`` options win)."""
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), Mapping) else {}
    return {**schema, "x-guidance": {**CALL_JSON["x-guidance"], **own}}


def _rebase(schema: Any, root: str) -> Any:
    """``schema`` with its local references (``#``, ``#/...``) made relative to ``root``."""
    if isinstance(schema, Mapping):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase(v, root))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase(v, root) for v in schema]
    return schema


def read_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolRequest | None:
    """OpenAI's ``tools`` (a list of function tools), ``tool_choice`` (none, auto, required, or
    ``{"type": "function", "function": {"name": ...}}``; unset: auto) and ``parallel_tool_calls``
    (unset: true) as a :class:`ToolRequest`; None without tools. ConfigError naming the field."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ConfigError(f"parallel_tool_calls: must be true or false, got {_type_name(parallel_tool_calls)}",
                          param="parallel_tool_calls")
    if tools is None or (isinstance(tools, (list, tuple)) and not tools):
        if tool_choice not in (None, "none"):
            raise ConfigError("tool_choice: needs tools (the functions the model may call)", param="tool_choice")
        return None
    if not isinstance(tools, (list, tuple)):
        raise ConfigError(f"tools: must be a list of tools, got {_type_name(tools)}", param="tools")
    functions = tuple(_function(t, f"tools.{i}") for i, t in enumerate(tools))
    names = [f.name for f in functions]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ConfigError(f"tools: function {twice!r} is given twice", param="tools")
    choice, named = "auto" if tool_choice is None else tool_choice, False
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, Mapping) or set(choice) != {"type", "function"} \
                or set(fn) != {"name"}:
            raise ConfigError("tool_choice: must be none, auto, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}} (nothing else)", param="tool_choice")
        if fn["name"] not in names:
            raise ConfigError(f"tool_choice.function.name: {fn.get('name')!r} is not one of the tools "
                              f"({', '.join(names)})", param="tool_choice")
        choice, named = fn["name"], True
    elif choice not in CHOICES:
        raise ConfigError(f"tool_choice: must be none, auto, required or {{\"type\": \"function\", \"function\": "
                          f"{{\"name\": ...}}}}, got {choice!r}", param="tool_choice")
    return ToolRequest(functions, choice, parallel_tool_calls is not False, named)


# -- reading calls out of an output -----------------------------------------------------------


@dataclass
class ToolCall:
    """One call of the answer: the function's name and its arguments (JSON text)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallDelta:
    """A streamed piece of call ``index``: its start (``id`` and ``name`` set) or more of its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


# a parser's events: text of the answer, a call's start (its name), more of the current call's arguments
_TEXT, _NAME, _ARGS = "text", "name", "args"


def _call_of(text: str, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments as JSON)`` of a call written as a JSON object with a string ``name`` and
    an object under one of ``keys``; None when ``text`` is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in keys if k in value), None)
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _call_events(text: str, keys: tuple[str, ...] = ("parameters", "arguments"), raw: str | None = None) -> list:
    """The events of an object read as a call (:func:`_call_of`): its name and arguments, or, when
    it is not one, ``raw`` (default: ``text``) as text."""
    call = _call_of(text, keys)
    return [(_NAME, call[0]), (_ARGS, call[1])] if call else [(_TEXT, text if raw is None else raw)]


def _held(text: str, marker: str) -> int:
    """How many of ``text``'s last characters could begin ``marker`` (held back until known)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _Text:
    """tool_choice none: the output is the answer's text."""

    def feed(self, text: str) -> list:
        return [(_TEXT, text)] if text else []

    def finish(self) -> list:
        return []


class _NamedCall:
    """A named function: the output is its arguments (the grammar's JSON)."""

    def __init__(self, name: str) -> None:
        self.name, self.started = name, False

    def _start(self) -> list:
        if self.started:
            return []
        self.started = True
        return [(_NAME, self.name)]

    def feed(self, text: str) -> list:
        return self._start() + ([(_ARGS, text)] if text else [])

    def finish(self) -> list:
        return self._start()


class _Objects:
    """Complete JSON objects (and arrays) of a text, found by depth outside strings."""

    def __init__(self, depth: int = 1) -> None:
        self.depth, self.at = depth, 0  # objects at this depth; the current depth
        self.in_string = self.escaped = False
        self.part = ""  # the current object's text so far

    def add(self, text: str) -> Iterable[tuple[str, str]]:
        """``("object", text)`` for each object ``text`` completes, ``("between", char)`` for the
        characters outside them."""
        for ch in text:
            inside = self.at >= self.depth
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.at += 1
                inside = self.at >= self.depth
            elif ch in "}]" and self.at > 0:  # a stray closer outside any object is text
                self.at -= 1
                if self.at == self.depth - 1 and inside:
                    self.part += ch
                    yield "object", self.part
                    self.part = ""
                    continue
            if inside:
                self.part += ch
            else:
                yield "between", ch


class _CallArray:
    """tool_choice required: the grammar's ``[{"name": ..., "parameters": {...}}, ...]``, a call
    per complete item (an item cut short by the token limit is text)."""

    def __init__(self) -> None:
        self.objects = _Objects(depth=2)

    def feed(self, text: str) -> list:
        events = []
        for kind, part in self.objects.add(text):
            if kind == "object":
                events += _call_events(part)
        return events

    def finish(self) -> list:
        return [(_TEXT, self.objects.part)] if self.objects.part else []


class _Hermes:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among text. A block
    whose JSON is not a call stays text, as written; so does an unclosed one that is not."""

    def __init__(self) -> None:
        self.text, self.inside = "", False

    def _block(self, body: str, closed: bool) -> list:
        return _call_events(body.strip(), ("arguments", "parameters"),
                            raw=HERMES_START + body + (HERMES_END if closed else ""))

    def feed(self, text: str) -> list:
        self.text += text
        events = []
        while True:
            if not self.inside:
                at = self.text.find(HERMES_START)
                if at < 0:
                    keep = _held(self.text, HERMES_START)
                    out, self.text = self.text[: len(self.text) - keep], self.text[len(self.text) - keep:]
                    return events + ([(_TEXT, out)] if out else [])
                if at:
                    events.append((_TEXT, self.text[:at]))
                self.text, self.inside = self.text[at + len(HERMES_START):], True
            else:
                at = self.text.find(HERMES_END)
                if at < 0:
                    return events
                events += self._block(self.text[:at], True)
                self.text, self.inside = self.text[at + len(HERMES_END):], False

    def finish(self) -> list:
        rest, self.text = self.text, ""
        if self.inside:
            return self._block(rest, False)
        return [(_TEXT, rest)] if rest else []


class _Llama3Json:
    """Llama 3's JSON calls: an output that begins with ``{`` (or ``<|python_tag|>``) is
    ``{"name": ..., "parameters": {...}}`` objects separated by ``;``; any other output is text.
    An object that is not a call stays text."""

    def __init__(self) -> None:
        self.mode: str | None = None  # "calls" or "text", once the output's start says which
        self.start = ""
        self.objects = _Objects(depth=1)
        self.between = ""  # text since the last object, held: separators between calls are dropped
        self.after_call = True  # the last object was a call (or there was none yet)

    def feed(self, text: str) -> list:
        if self.mode is None:
            self.start += text
            head = self.start.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return []
            self.mode = "calls" if head.startswith(("{", PYTHON_TAG)) else "text"
            text = head.removeprefix(PYTHON_TAG) if self.mode == "calls" else self.start
        if self.mode == "text":
            return [(_TEXT, text)] if text else []
        events = []
        for kind, part in self.objects.add(text):
            if kind == "between":
                self.between += part
                continue
            read = _call_events(part)
            call = read[0][0] == _NAME
            if self.between and not (call and self.after_call and not self.between.strip("; \n\t\r")):
                events.append((_TEXT, self.between))
            self.between, self.after_call = "", call
            events += read
        return events

    def finish(self) -> list:
        if self.mode is None:
            return [(_TEXT, self.start)] if self.start else []
        rest = self.objects.part
        if self.between and (rest or not self.after_call or self.between.strip("; \n\t\r")):
            rest = self.between + rest
        return [(_TEXT, rest)] if rest else []


def auto_parser(name: str | None):
    if name is None:
        raise ConfigError("tool_choice: 'auto' (the default with tools) needs to know how this model writes a "
                          f"call; start the server with --tool-call-parser ({', '.join(PARSERS)}) or --chat-template "
                          "hermes (a ChatML template whose calls are Hermes-style), or ask for tool_choice "
                          "'required' or a named function", param="tool_choice")
    return {"hermes": _Hermes, "llama3_json": _Llama3Json}[choose_parser(name, None)]()


class ToolStream:
    """One choice's output, as it comes, read into the answer's deltas: text (``ContentDelta``)
    and calls (``CallDelta``). Whitespace at the end of the text so far is held until more text
    follows, and dropped if the answer has calls; after ``max_calls`` calls (None: no limit) the rest of the
    output is not read."""

    def __init__(self, parser, max_calls: int | None) -> None:
        self.parser, self.max_calls = parser, max_calls
        self.calls = 0
        self.held = ""  # whitespace-only text not yet sent
        self.ended = False  # max_calls reached

    def _deltas(self, events: list) -> list:
        out = []
        for kind, value in events:
            if self.ended:
                break
            if kind == _TEXT:  # trailing whitespace held, wherever the text was cut
                text = self.held + value
                kept = text.rstrip()
                if kept:
                    out.append(ContentDelta(kept))
                self.held = text[len(kept):]
            elif kind == _NAME:
                if self.max_calls is not None and self.calls >= self.max_calls:
                    self.ended = True
                    break
                self.calls += 1
                out.append(CallDelta(self.calls - 1, id=f"call_{secrets.token_hex(12)}", name=value))
            elif value:
                out.append(CallDelta(self.calls - 1, arguments=value))
        return out

    def add(self, text: str) -> list:
        return self._deltas(self.parser.feed(text)) if text and not self.ended else []

    def end(self) -> list:
        out = [] if self.ended else self._deltas(self.parser.finish())
        if self.held and not self.calls:
            out.append(ContentDelta(self.held))
        self.held = ""
        return out

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output as ``(content or None, calls)``."""
        return assemble(self.add(text) + self.end())


def assemble(deltas: Sequence) -> tuple[str | None, list[ToolCall]]:
    """Deltas joined: the answer's text (None when empty) and its calls."""
    content, calls = "", []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content += delta.text
        elif delta.name is not None:
            calls.append(ToolCall(delta.name, delta.arguments, delta.id))
        else:
            calls[delta.index].arguments += delta.arguments
    return content or None, calls


@dataclass
class ChatResult:
    """:meth:`SpeculativeDecoder.chat`'s answer: its text (None when it only calls tools), its
    tool calls, the finish reason ("tool_calls" when an answer that ended by itself calls tools;
    else the generation's: "eos", "stop", "length") and the generation's result (tokens, stats)."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    result: Any

    @classmethod
    def of(cls, result, reader: ToolStream | None, request: ToolRequest | None) -> "ChatResult":
        content, calls = reader.read(result.text or "") if reader is not None else (result.text, [])
        return cls(content, calls, calls_finish_reason(result.finish_reason, len(calls), request), result)


def calls_finish_reason(reason: str, calls: int, request: ToolRequest | None) -> str:
    """"tool_calls" for an answer that ended by itself (EOS or a stop) with ``calls`` calls, unless
    the request named the function (OpenAI says "stop" then); else ``reason``."""
    if calls and request is not None and not request.named and reason in ("eos", "stop"):
        return "tool_calls"
    return reason


# -- the conversation and the chat template ----------------------------------------------------


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The messages as chat templates read them: an assistant's ``tool_calls`` with their
    ``arguments`` JSON text parsed into objects (templates write them with ``tojson``).
    ConfigError naming the message for arguments that are not a JSON object."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if not calls:
            out.append(message)
            continue
        entry, read = dict(message), []
        for j, call in enumerate(calls):
            at = f"messages.{i}.tool_calls.{j}"
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(call.get("id"), str) \
                    or call.get("type", "function") != "function":
                raise ConfigError(f"{at}: a tool call must be {{\"id\": \"...\", \"type\": \"function\", \"function\": "
                                  "{\"name\": ..., \"arguments\": \"{...}\"}}", param=at)
            extra = sorted(set(call) - {"id", "type", "function"}) or sorted(f"function.{k}" for k in set(fn) - {
                "name", "arguments"})
            if extra:
                raise ConfigError(f"{at}.{extra[0]}: unknown key; a tool call is {{\"id\", \"type\", \"function\": "
                                  "{\"name\", \"arguments\"}}", param=f"{at}.{extra[0]}")
            arguments = fn.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments or "{}", parse_constant=_no_constant)
                except ValueError as exc:
                    raise ConfigError(f"{at}.function.arguments: not valid JSON: {exc}",
                                      param=f"{at}.function.arguments") from None
            if not isinstance(arguments, dict):
                raise ConfigError(f"{at}.function.arguments: must be a JSON object", param=f"{at}.function.arguments")
            read.append({**call, "type": "function", "function": {**fn, "arguments": arguments}})
        entry["tool_calls"] = read
        out.append(entry)
    return out


def template_source(tokenizer, tools: bool) -> str | None:
    """The chat template the tokenizer renders with (its ``tool_use`` one with tools, as transformers picks)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("tool_use") if tools and "tool_use" in template else template.get("default")
    return template if isinstance(template, str) else None


def _variables(source: str) -> set[str]:
    import jinja2
    from jinja2 import meta

    try:
        return meta.find_undeclared_variables(jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source))
    except jinja2.TemplateError:  # tags of transformers' own ({% generation %}): the names the text has
        return set(re.findall(r"[A-Za-z_]\w*", source))


def check_template(tokenizer, tools: bool, messages: Sequence[Mapping[str, Any]]) -> None:
    """ConfigError when the chat template would drop what the request gives: tools it never
    reads, or an assistant's tool calls it never writes."""
    source = template_source(tokenizer, tools)
    if source is None:
        return
    hint = "start the server with --chat-template hermes (specdraft's ChatML template with tools) or a template of " \
           "your own (from_pretrained(chat_template=...))"
    if tools and "tools" not in _variables(source):
        raise ConfigError(f"tools: this model's chat template does not show tools to the model; {hint}", param="tools")
    for i, message in enumerate(messages):
        if isinstance(message, Mapping) and message.get("tool_calls") and "tool_calls" not in source:
            raise ConfigError(f"messages.{i}.tool_calls: this model's chat template does not write an assistant's "
                              f"tool calls; {hint}", param=f"messages.{i}.tool_calls")


#: the chat templates specdraft ships, by the name ``--chat-template`` takes
TEMPLATES = ("hermes",)


def load_chat_template(value: str) -> str:
    """``--chat-template``'s value as template text: one of :data:`TEMPLATES`, a file, or the
    template itself (text with ``{{`` or ``{%``)."""
    from pathlib import Path

    if not isinstance(value, str) or not value:
        raise ConfigError(f"chat_template must be a template's name ({', '.join(TEMPLATES)}), a file or Jinja text, "
                          f"got {value!r}", param="chat_template")
    if value in TEMPLATES:
        return (Path(__file__).parent / "templates" / f"{value}.jinja").read_text()
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"chat template {value!r} is not a file, Jinja text or one of specdraft's "
                          f"({', '.join(TEMPLATES)})", param="chat_template")
    return path.read_text()


def choose_parser(name: str | None, tokenizer) -> str | None:
    """The ``auto`` parser: ``name`` (one of :data:`PARSERS`), else the one the chat template's
    own call format needs (None: none known)."""
    if name is not None:
        if name not in PARSERS:
            raise ConfigError(f"tool call parser {name!r} is not one specdraft has; it has {', '.join(PARSERS)}",
                              param="tool_call_parser")
        return name
    return detect_parser(tokenizer)


def detect_parser(tokenizer) -> str | None:
    """The ``auto`` parser the chat template's own call format needs (None: none known)."""
    source = template_source(tokenizer, True) or ""
    if HERMES_START in source:
        return "hermes"
    if PYTHON_TAG in source or '"parameters"' in source:
        return "llama3_json"
    return None


__all__ = ["CallDelta", "ChatResult", "ContentDelta", "Function", "PARSERS", "TEMPLATES", "ToolCall", "ToolRequest", "ToolStream",
           "assemble", "check_template", "choose_parser", "load_chat_template", "read_tools", "template_messages"]
