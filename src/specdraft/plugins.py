"""Plugin manager and drafter registry.

Built-in drafters and third-party ones arrive through the same ``register_drafters``
hook. Third-party plugins are packages exposing an entry point in the ``specdraft``
group; ``SPECDRAFT_LOAD_PLUGINS`` (comma-separated distribution or entry-point names)
limits which of them load, and an empty value loads none.

A plugin that fails to import, fails validation, or raises inside its hook is recorded
in :data:`load_errors` / ``Registry.errors`` by name; the other plugins still work.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import pluggy

from . import hookspecs
from .errors import (
    ConfigError,
    DrafterError,
    PluginError,
    SpecdraftError,
    UnknownDrafterError,
    describe_validation_error,
)

ENTRY_POINT_GROUP = "specdraft"
LOAD_PLUGINS_ENV = "SPECDRAFT_LOAD_PLUGINS"
BUILTIN_PLUGIN = "specdraft"
DEFAULT_PLUGINS = ("specdraft.drafters.builtin",)

pm = pluggy.PluginManager("specdraft")
pm.add_hookspecs(hookspecs)

#: ``(plugin name, message)`` for every plugin that could not be loaded.
load_errors: list[tuple[str, str]] = []


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _allowed() -> set[str] | None:
    raw = os.environ.get(LOAD_PLUGINS_ENV)
    if raw is None:
        return None
    return {_normalize(n) for n in raw.split(",") if n.strip()}


def _register_checked(plugin: object, name: str) -> None:
    """Register ``plugin`` and validate its hooks; on failure leave ``pm`` as it was and raise."""
    pm.register(plugin, name=name)
    try:
        pm.check_pending()  # a hook name that matches no spec (a typo) fails here
    except Exception:
        pm.unregister(plugin)
        raise


def load_plugins() -> None:
    """Register the built-ins and every allowed entry point not registered yet."""
    for module_name in DEFAULT_PLUGINS:
        if pm.get_plugin(BUILTIN_PLUGIN) is None:
            _register_checked(importlib.import_module(module_name), BUILTIN_PLUGIN)
    allowed = _allowed()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else ep.name
        if allowed is not None and not ({_normalize(dist), _normalize(ep.name)} & allowed):
            continue
        if pm.get_plugin(dist) is not None or any(p == dist for p, _ in load_errors):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's
            load_errors.append((dist, f"failed to import {ep.value!r}: {type(exc).__name__}: {exc}"))
            continue
        try:
            _register_checked(plugin, dist)
        except Exception as exc:  # noqa: BLE001
            load_errors.append((dist, f"invalid plugin: {exc}"))


@dataclass(frozen=True)
class DrafterSpec:
    """One registered drafter name."""

    name: str
    cls: type
    plugin: str
    aliases: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Registry:
    """Drafters by name, built fresh from the plugin manager's hooks."""

    drafters: dict[str, DrafterSpec] = field(default_factory=dict)  # every name and alias
    claims: dict[str, list[str]] = field(default_factory=dict)  # name -> plugins that registered it
    errors: list[tuple[str, str]] = field(default_factory=list)  # (plugin, message)

    def names(self) -> list[str]:
        """Canonical names of the usable drafters (aliases excluded)."""
        return sorted({s.name for n, s in self.drafters.items() if len(self.claims[n]) == 1})

    def specs(self) -> list[DrafterSpec]:
        seen: dict[str, DrafterSpec] = {}
        for spec in self.drafters.values():
            seen.setdefault(spec.name, spec)
        return [seen[n] for n in sorted(seen)]

    def get(self, name: str) -> DrafterSpec:
        key = _normalize(name)
        if key not in self.drafters:
            known = ", ".join(self.names()) or "(none)"
            raise UnknownDrafterError(f"unknown drafter {name!r}; known drafters: {known}")
        owners = self.claims[key]
        if len(owners) > 1:
            raise PluginError(
                f"drafter name {name!r} is registered by more than one plugin: "
                f"{' and '.join(repr(o) for o in owners)}; uninstall one of them or limit "
                f"{LOAD_PLUGINS_ENV}"
            )
        return self.drafters[key]

    def validate_options(self, name: str, options: Mapping[str, Any] | None):
        """The drafter's ``Options`` instance for ``options`` (over its registered defaults)."""
        from pydantic import ValidationError

        spec = self.get(name)
        options_cls = getattr(spec.cls, "Options")
        try:
            return options_cls.model_validate({**spec.defaults, **(options or {})})
        except ValidationError as exc:
            valid = ", ".join(options_cls.model_fields) or "(none)"
            raise ConfigError(
                f"invalid options for drafter {spec.name!r}: {describe_validation_error(exc)}. Valid options: {valid}"
            ) from None

    def create(self, name: str, options: Mapping[str, Any] | None, target: Any):
        """Validate ``options`` against the drafter's ``Options`` and build the drafter."""
        spec = self.get(name)
        opts = self.validate_options(name, options)
        try:
            drafter = spec.cls(opts, target)
        except Exception as exc:  # noqa: BLE001 - surface the plugin's failure by name
            if isinstance(exc, SpecdraftError):  # already says what to do
                raise
            raise DrafterError(
                f"drafter {spec.name!r} (plugin {spec.plugin!r}) failed to start: {type(exc).__name__}: {exc}"
            ) from exc
        drafter.name, drafter.plugin = spec.name, spec.plugin
        return drafter


def get_registry() -> Registry:
    """Call every ``register_drafters`` hook (each in isolation) and collect the drafters."""
    from .drafters.base import Drafter

    load_plugins()
    registry = Registry(errors=list(load_errors))
    for impl in pm.hook.register_drafters.get_hookimpls():
        plugin_name = pm.get_name(impl.plugin) or impl.plugin_name
        pending: list[DrafterSpec] = []

        def register(name, drafter_cls, aliases=(), defaults=None, _plugin=plugin_name, _pending=pending):
            if not (isinstance(drafter_cls, type) and issubclass(drafter_cls, Drafter)):
                raise TypeError(f"{drafter_cls!r} is not a subclass of specdraft.Drafter")
            _pending.append(DrafterSpec(
                name=_normalize(name), cls=drafter_cls, plugin=_plugin,
                aliases=tuple(_normalize(a) for a in aliases), defaults=dict(defaults or {}),
            ))

        try:
            impl.function(register=register)
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not take the rest down
            registry.errors.append((plugin_name, f"register_drafters raised {type(exc).__name__}: {exc}"))
            continue
        for spec in pending:  # all of a plugin's drafters, or none of them
            for key in (spec.name, *spec.aliases):
                registry.claims.setdefault(key, []).append(spec.plugin)
                registry.drafters.setdefault(key, spec)
    return registry
