"""Reading a request's body: JSON only, within the size and nesting limits, valid Unicode, then
validated as the route's protocol model; every refusal an :class:`~.errors.APIError` naming where."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from .errors import APIError, invalid
from .protocol import OpenAIBaseModel

#: the largest request body read (bytes; ``create_app(max_request_bytes=...)``, ``serve
#: --max-request-bytes``): 8 MiB holds a prompt far longer than any context (a token is a few
#: bytes of text), and caps what one request can make the server parse and tokenize
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
#: arrays and objects in a request body nest at most this deep (a real request nests 4 or 5)
MAX_JSON_DEPTH = 64


def _too_large(limit: int, what: str) -> APIError:
    return APIError(413, f"the request body is too large ({what}); this server reads at most {limit} bytes: send a "
                         "shorter prompt, or start the server with a larger --max-request-bytes",
                    code="request_too_large")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``limit`` bytes: by its
    Content-Length before reading any of it, or while a chunked one arrives (never buffered whole)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, f"Content-Length {int(declared)}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, f"more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> dict:
    """The request's body as a JSON object; APIError: 415 for a content type other than
    ``application/json``, 413 for a body over ``limit`` bytes, 400 for an empty body, bad JSON,
    nesting deeper than ``MAX_JSON_DEPTH`` or a lone surrogate in a string."""
    media = request.headers.get("content-type")
    if media is None or media.split(";", 1)[0].strip().lower() != "application/json":
        got = f"got {media.split(';', 1)[0].strip()!r}" if media else "it has none"
        raise APIError(415, f"the request body must be JSON sent with the header `Content-Type: application/json` "
                            f"({got}); with curl, add -H 'Content-Type: application/json'",
                       code="unsupported_media_type")
    raw = await _read_body(request, limit)
    if not raw.strip():
        raise APIError(400, "the request body is empty; send the parameters as a JSON object")
    try:
        # strict UTF-8: json.loads(bytes) would let encoded surrogates (b"\xed\xa0\x80") through
        data = json.loads(raw.decode("utf-8"), parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} (at character {exc.pos})") from None
    except _NotJSON as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc} is not a JSON number; send a number "
                            "or null") from None
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: it is not UTF-8 text (byte {exc.start}); "
                            "send the JSON encoded as UTF-8") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError:  # Python's bound on converting a long digit string to an int
        raise APIError(400, f"the request body has a number of more than {sys.get_int_max_str_digits()} digits; "
                            "no parameter takes one that long") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", type(None): "null"}.get(type(data), "a number or boolean")
        raise APIError(400, f"the request body must be a JSON object of parameters, got {kind}")
    _check_json(raw, data)
    return data


class _NotJSON(ValueError):
    pass


def _not_json(constant: str):
    """``json.loads`` accepts NaN, Infinity and -Infinity, which JSON does not have: refused."""
    raise _NotJSON(constant)


def _too_deep() -> APIError:
    return APIError(400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
                         "send the parameters as documented (a request nests a few levels)")


#: a JSON escape of a UTF-16 surrogate (\ud800-\udfff): only such escapes can give a string one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_json(raw: bytes, data: Any) -> None:
    """400 for nesting deeper than ``MAX_JSON_DEPTH``, and for a string or a key that holds a lone
    surrogate (JSON's ``"\\ud800"`` unpaired: no tokenizer takes it); the 400 names where. The
    walk runs only when ``raw`` could hold either (it has that many brackets, or such an escape)."""
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if not (deep or surrogates):
        return
    stack: list[tuple[tuple, Any, int]] = [((), data, 1)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, str):
            if surrogates:
                _check_text(value, ".".join(map(str, path)))
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        items = list(value.items() if isinstance(value, dict) else enumerate(value))
        for key, item in reversed(items):  # the first member is checked first
            if isinstance(key, str) and surrogates:
                _check_text(key, ".".join(map(str, (*path, key))), "the parameter name ")
            stack.append(((*path, key), item, depth + 1))


def _check_text(text: str, where: str, what: str = "") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = where.encode("utf-8", "backslashreplace").decode("utf-8")
        raise APIError(400, f"{what}{where or 'the body'} is not valid text: it holds a lone surrogate "
                            f"({text[exc.start:exc.end]!r}) at character {exc.start}; send valid Unicode (a "
                            "\\ud800-\\udfff escape must be half of a pair)", param=where or None) from None


def validate(data: dict, model: type[OpenAIBaseModel]):
    """``data`` as ``model``; APIError (400) naming the parameter at fault."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc, data=data) from None


async def parse(request: Request, model: type[OpenAIBaseModel], limit: int = DEFAULT_MAX_REQUEST_BYTES):
    """The request's JSON body (see :func:`read_json`) as ``model``."""
    return validate(await read_json(request, limit), model)

