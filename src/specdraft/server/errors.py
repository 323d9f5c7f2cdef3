"""The server's errors: OpenAI's error JSON (:class:`APIError`), what each failure is answered with,
and the parameter a 400 names."""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..errors import ConfigError, DrafterError, QueueFull, SpecdraftError, describe_validation_error
from .protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("specdraft.server")

#: the ``Retry-After`` (seconds) of a 429: a place in the queue frees as soon as a request ends
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error answered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, _one_line(message), type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _one_line(text: str) -> str:
    # lone surrogates (from a request's "\ud800") cannot be encoded as UTF-8: escaped
    return " ".join(str(text).encode("utf-8", "backslashreplace").decode("utf-8").split()) or "error"


def as_api_error(exc: BaseException) -> APIError:
    """The status and message a failure is answered with; logs the unexpected ones."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, ConfigError):
        return APIError(400, str(exc))
    if isinstance(exc, DrafterError):
        return APIError(500, str(exc), type="server_error", code="drafter_error")
    if isinstance(exc, SpecdraftError):
        return APIError(500, str(exc), type="server_error")
    logger.error("unexpected error while serving a request", exc_info=exc)
    first = (str(exc).strip().splitlines() or [""])[0]
    return APIError(500, f"internal error: {type(exc).__name__}{': ' + first if first else ''} (logged by the server)",
                    type="server_error", code="internal_error")


class ValidationErrors:
    """pydantic's errors, with ``errors()`` as a ValidationError has it (what :func:`invalid` reads)."""

    def __init__(self, errors) -> None:
        self._errors = list(errors)

    def errors(self) -> list[dict]:
        return self._errors


def body_errors(exc: RequestValidationError) -> ValidationErrors:
    """A RequestValidationError's errors with the leading ``body`` dropped from each location."""
    return ValidationErrors(dict(e, loc=tuple(e.get("loc", ()))[1:] if tuple(e.get("loc", ()))[:1] == ("body",)
                                 else tuple(e.get("loc", ()))) for e in exc.errors())



def invalid(exc, what: str = "invalid request", data: Any = None) -> APIError:
    """A 400 from pydantic's errors (``exc.errors()``), naming the first parameter at fault (an
    unknown one first: ``unknown parameter 'X'``). With ``data`` (the request's JSON), the name
    stops where the body does (pydantic adds a union member's type to the location)."""
    everything = ValidationErrors(dict(e, loc=client_loc(e.get("loc", ()))) for e in exc.errors())
    errors = [e for e in everything.errors() if e["loc"]]
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        param = ".".join(str(p) for p in unknown[0]["loc"])
        return APIError(400, f"unknown parameter {param!r}: specdraft's server does not take it; remove it "
                             "(docs/serving.md lists the parameters it takes)", param=param, code="unknown_parameter")
    # of the errors about the first one's field, the deepest: a union's members each add one, and
    # the member the body's shape matches goes furthest into it (content.0.text, not content)
    paths = [param_path(e["loc"], None if e.get("type") == "missing" else data)
             for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
    param = max(paths, key=lambda path: path.count(".")) if paths else None
    return APIError(400, f"{what}: {describe_validation_error(everything)}", param=param)


#: what pydantic adds to an error's location for the member of a union it tried (``list[TextPart]``,
#: ``str``, ``TextPart``, ``function-after[...]``): not a field a client wrote
_TYPE_LABEL = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|[\w-]+\[.*\])$")


def client_loc(loc) -> tuple:
    """An error's location as the client wrote the body: pydantic's union labels dropped
    (``prediction.content.list[TextPart].0.image_url`` -> ``prediction.content.0.image_url``)."""
    return tuple(p for p in loc if not (isinstance(p, str) and _TYPE_LABEL.match(p)))


def param_path(loc: tuple, data: Any) -> str:
    """``loc`` as a dotted parameter name, cut where ``data`` has no such member (None: not cut,
    e.g. for a missing field)."""
    if data is None:
        return ".".join(str(p) for p in loc)
    parts, node = [], data
    for key in loc:
        member = isinstance(node, dict) and key in node
        if member or isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            parts.append(str(key))
            node = node[key]
        else:
            break
    return ".".join(parts) or ".".join(str(p) for p in loc)


def config_param(exc: ConfigError, prompt_param: str, max_tokens_param: str = "max_tokens") -> str | None:
    """The request field a ConfigError is about: its ``param`` (a setting's or an input's name; a
    nested part by the field it is in), with the names the request gives the prompt and the limit."""
    if exc.param is None:
        return None
    field = exc.param.split(".")[0]
    return {"prompt": prompt_param, "max_new_tokens": max_tokens_param}.get(field, field)

