"""``specdraft serve``: an OpenAI-compatible HTTP server (``pip install 'specdraft[serve]'``).

``create_app(decoder)`` builds the FastAPI app; FastAPI is imported only when it is called,
so importing this package (as the CLI does to register ``serve``) stays instant.
"""

from __future__ import annotations

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
