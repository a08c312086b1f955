"""OpenAI-compatible HTTP server with chunk reuse, prefix-grouped batching and token streaming.

``create_app(engine, settings)`` (in :mod:`kvboost_hf.server.app`) builds the FastAPI app; ``kvboost-hf serve``
or ``python -m kvboost_hf.server`` runs it. FastAPI and uvicorn are imported only when the app is built, so
importing this package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvboost_hf.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvboost_hf.server import app

        return getattr(app, name)
    raise AttributeError(name)
