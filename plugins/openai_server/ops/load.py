"""vLLM's server-load figure: ``GET /load`` answers ``{"server_load": N}``, the number of requests in flight on the
routes that run the model. Counted only with ``--enable-server-load-tracking`` (vLLM's flag), else always 0.

The count is an ASGI middleware: a request enters on arrival and leaves when its response has been sent in full (a
stream when its last event is out, or when its client goes away), so a load balancer sees streams as load.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

#: The routes counted (vLLM's list, plus the SageMaker route that dispatches to them).
LOAD_TRACKED_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/score",
        "/v1/rerank",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/v2/rerank",
        "/invocations",
    }
)


class ServerLoad:
    """The in-flight counter one app shares between its middleware and ``/load``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.value = 0


class ServerLoadMiddleware:
    """Counts the requests in flight on :data:`LOAD_TRACKED_PATHS` into ``load``."""

    def __init__(self, app: Any, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not (self.load.enabled and scope["type"] == "http" and _route_path(scope) in LOAD_TRACKED_PATHS):
            await self.app(scope, receive, send)
            return
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1


def _route_path(scope: dict[str, Any]) -> str:
    """The request's path without the ``--root-path`` prefix (a proxy may or may not have stripped it)."""
    path: str = scope.get("path", "")
    root = scope.get("root_path") or ""
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.rstrip("/") or "/"


def load_router(load: ServerLoad) -> APIRouter:
    """``GET /load``."""
    from vllite.plugins.openai_server.http_common import json_response

    router = APIRouter()

    @router.get("/load")
    async def server_load() -> Response:
        return json_response({"server_load": load.value})

    return router
