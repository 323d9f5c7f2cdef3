"""Plugin manager and drafter registry.

Built-in drafters and third-party ones arrive through the same ``register_drafters``
hook. Third-party plugins are packages exposing an entry point in the ``specdraft``
group; ``SPECDRAFT_LOAD_PLUGINS`` (comma-separated distribution or entry-point names)
limits which of them load, and an empty value loads none.

A plugin that fails to import, fails validation, or raises inside its hook is recorded
in :data:`load_errors` / ``Registry.errors`` by name; the other plugins still work, and
asking for a drafter that is missing names those plugins.

A drafter may be registered by import path (``"package.module:Class"``) with its
``options`` class: listing drafters and checking options then import nothing heavy, and
the module loads when the drafter is created (the built-in heads wait for torch this way).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
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

#: plugin name -> its entry points' names, which often are the names of the drafters it provides
entry_point_names: dict[str, set[str]] = {}


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
        entry_point_names.setdefault(dist, set()).add(_normalize(ep.name))
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's
            load_errors.append((dist, f"failed to import {ep.value!r}: {type(exc).__name__}: {exc}"))
            continue
        try:
            _register_checked(plugin, dist)
        except Exception as exc:  # noqa: BLE001
            load_errors.append((dist, f"failed validation: {exc}"))


@dataclass(frozen=True)
class DrafterSpec:
    """One registered drafter name."""

    name: str
    drafter: type | str  # the Drafter subclass, or its "module:attribute", imported by ``cls``
    options: type  # the drafter's ``Options`` (pydantic model)
    plugin: str
    aliases: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def cls(self) -> type:
        """The drafter class (importing its module, for one registered by import path)."""
        if not isinstance(self.drafter, str):
            return self.drafter
        module, _, attr = self.drafter.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's
            raise PluginError(f"drafter {self.name!r} (plugin {self.plugin!r}) failed to import {self.drafter!r}: "
                              f"{type(exc).__name__}: {exc}") from exc
        if getattr(cls, "Options", None) is not self.options:
            raise PluginError(f"drafter {self.name!r} (plugin {self.plugin!r}): {self.drafter} has other Options "
                              "than the ones registered with it")
        return cls


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
            raise UnknownDrafterError(self._unknown(name))
        owners = self.claims[key]
        if len(owners) > 1:
            raise PluginError(
                f"drafter name {name!r} is registered by more than one plugin: "
                f"{' and '.join(repr(o) for o in owners)}; uninstall one of them or limit "
                f"{LOAD_PLUGINS_ENV}"
            )
        return self.drafters[key]

    def _unknown(self, name: str) -> str:
        """Why ``name`` is not registered: a broken plugin that would provide it, or the known names."""
        key = _normalize(name)
        for plugin, error in self.errors:
            names = {_normalize(plugin), _normalize(plugin).removeprefix("specdraft-"),
                     *entry_point_names.get(plugin, ())}
            if key in names:
                return (f"unknown drafter {name!r}: plugin {plugin!r}, which would provide it, {error}; "
                        "fix or uninstall that plugin")
        known = ", ".join(self.names()) or "(none)"
        notes = "".join(f"; note plugin {plugin!r} {error}" for plugin, error in self.errors)
        return f"unknown drafter {name!r}; known drafters: {known}{notes}"

    def validate_options(self, name: str, options: Mapping[str, Any] | None):
        """The drafter's ``Options`` instance for ``options`` (over its registered defaults)."""
        from pydantic import ValidationError

        spec = self.get(name)
        options_cls = spec.options
        try:
            return options_cls.model_validate({**spec.defaults, **(options or {})})
        except ValidationError as exc:
            # the drafter's own options first, then those it inherits (tree_budget, heads, ...)
            own = inspect.get_annotations(options_cls)
            fields = sorted(options_cls.model_fields, key=lambda f: f not in own)
            valid = ", ".join(fields) or "(none)"
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


#: the registry last built, and the plugins (and load errors) it was built from
_built: tuple[tuple, Registry] | None = None


def get_registry() -> Registry:
    """The drafters every registered plugin provides: built once (every ``register_drafters`` hook
    called, each in isolation), and again only when the registered plugins change."""
    global _built
    load_plugins()
    # the plugin objects themselves (not their ids, which a new plugin may reuse) and the errors' copy
    key = (tuple(sorted(pm.get_plugins(), key=id)), tuple(load_errors))
    if _built is None or _built[0] != key:
        _built = (key, _build_registry())
    return _built[1]


def _build_registry() -> Registry:
    from pydantic import BaseModel

    from .drafters.api import Drafter

    registry = Registry(errors=list(load_errors))
    for impl in pm.hook.register_drafters.get_hookimpls():
        plugin_name = pm.get_name(impl.plugin) or impl.plugin_name
        pending: list[DrafterSpec] = []

        def register(name, drafter_cls, aliases=(), defaults=None, options=None, _plugin=plugin_name,
                     _pending=pending):
            if isinstance(drafter_cls, str):  # "module:Class", imported when the drafter is created
                if ":" not in drafter_cls or not (isinstance(options, type) and issubclass(options, BaseModel)):
                    raise TypeError(f"a drafter registered by import path ({drafter_cls!r}) needs the form "
                                    "'module:Class' and options=its Options class")
            elif not (isinstance(drafter_cls, type) and issubclass(drafter_cls, Drafter)):
                raise TypeError(f"{drafter_cls!r} is not a subclass of specdraft.Drafter")
            elif options not in (None, drafter_cls.Options):
                raise TypeError(f"options= differs from {drafter_cls.__name__}.Options; leave it out")
            _pending.append(DrafterSpec(
                name=_normalize(name), drafter=drafter_cls, options=options or drafter_cls.Options, plugin=_plugin,
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
