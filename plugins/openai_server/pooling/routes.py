"""The pooling routes' HTTP side, as vLLM serves them.

- ``POST /v1/embeddings`` (OpenAI's; behind ``--api-key`` like every ``/v1`` route), ``POST /v1/score``,
  ``POST /v1/rerank``: added to the ``/v1`` router by :func:`add_v1_pooling_routes`.
- ``POST /pooling``, ``/classify``, ``/score``, ``/rerank``, ``/v2/rerank``: :func:`pooling_router`.

A generating model answers each with 400 naming its tasks; a client that disconnects aborts the request's engine
requests at once, as on the generating routes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.pooling.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)


async def _answer(ctx: ServerContext, request: Request, work: Callable[[], Awaitable[Any]]) -> Response:
    from vllite.plugins.openai_server.http_common import cancel_on_disconnect, json_response

    if ctx.engine.errored:
        raise ctx.engine.dead_error
    result = await cancel_on_disconnect(request, work())
    return result if isinstance(result, Response) else json_response(result)


def add_v1_pooling_routes(router: APIRouter, ctx: ServerContext) -> None:
    """``/embeddings``, ``/score`` and ``/rerank`` on the ``/v1`` router (its API-key check included)."""
    from vllite.plugins.openai_server.pooling.serving import create_embedding, create_rerank, create_score

    @router.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await _answer(ctx, request, lambda: create_embedding(ctx, body))

    @router.post("/score")
    async def score_v1(body: ScoreRequest, request: Request) -> Response:
        return await _answer(ctx, request, lambda: create_score(ctx, body))

    @router.post("/rerank")
    async def rerank_v1(body: RerankRequest, request: Request) -> Response:
        return await _answer(ctx, request, lambda: create_rerank(ctx, body, "/v1/rerank"))


def pooling_router(ctx: ServerContext) -> APIRouter:
    """vLLM's pooling routes outside ``/v1``: ``/pooling``, ``/classify``, ``/score``, ``/rerank``, ``/v2/rerank``."""
    from vllite.plugins.openai_server.pooling.serving import (
        create_classification,
        create_pooling,
        create_rerank,
        create_score,
    )

    router = APIRouter()

    @router.post("/pooling")
    async def pooling(body: PoolingRequest, request: Request) -> Response:
        return await _answer(ctx, request, lambda: create_pooling(ctx, body))

    @router.post("/classify")
    async def classify(body: ClassificationRequest, request: Request) -> Response:
        return await _answer(ctx, request, lambda: create_classification(ctx, body))

    @router.post("/score")
    async def score(body: ScoreRequest, request: Request) -> Response:
        return await _answer(ctx, request, lambda: create_score(ctx, body))

    @router.post("/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await _answer(ctx, request, lambda: create_rerank(ctx, body))

    @router.post("/v2/rerank")
    async def rerank_v2(body: RerankRequest, request: Request) -> Response:
        return await _answer(ctx, request, lambda: create_rerank(ctx, body, "/v2/rerank"))

    return router
