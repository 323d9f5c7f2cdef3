"""Errors that reach users. Each message says what went wrong and what to do."""

from __future__ import annotations


class SpecdraftError(Exception):
    """Base class of every error specdraft raises on purpose.

    The CLI prints these as one line and exits non-zero; anything else is a bug.
    """


class ConfigError(SpecdraftError, ValueError):
    """A setting or an input is invalid (bad sampling values, empty prompt, ...).

    ``param``: the setting or input at fault, by its Python name (``"temperature"``, ``"stop"``,
    ``"prompt"``, ``"response_format.json_schema"``, ...), or None when it is no one setting's;
    the server answers with the request field it comes from."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(SpecdraftError):
    """A model or tokenizer could not be found or loaded."""


class UnknownDrafterError(SpecdraftError, KeyError):
    """No drafter is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0])


class PluginError(SpecdraftError):
    """A plugin failed to load, registered badly, or raised inside a hook."""


class QueueFull(SpecdraftError):
    """The engine's waiting queue is full: the request was not taken; retry later."""


class DrafterError(SpecdraftError):
    """A drafter raised, or returned a draft that breaks the Draft contract."""


def describe_validation_error(exc) -> str:
    """One readable line from a pydantic ``ValidationError``: ``field: message; ...``."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'value'}: {err['msg']}"
        + (f" (got {err['input']!r})" if not isinstance(err.get("input"), dict) else "")
        for err in exc.errors()
    )
