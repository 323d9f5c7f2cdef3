"""Hook specifications: the whole plugin interface of specdraft."""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("specdraft")
hookimpl = pluggy.HookimplMarker("specdraft")


@hookspec
def register_drafters(register):
    """Register drafters by calling ``register(name, drafter_cls, aliases=(), defaults=None)``.

    :param register: callback; ``drafter_cls`` subclasses :class:`specdraft.Drafter`,
        ``aliases`` are extra names for it, and ``defaults`` pre-fills options (for a
        name that means "this drafter with these settings"). ``drafter_cls`` may also be an
        import path, ``"package.module:Class"``, with ``options=`` its ``Options`` class: the
        module is imported only when the drafter is created (keep a heavy module out of
        ``specdraft drafters`` and option checks).
    """
