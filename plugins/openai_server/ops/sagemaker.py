"""The routes Amazon SageMaker calls, as vLLM serves them: ``/ping`` (GET or POST: ``/health``'s answer) and
``POST /invocations``, which runs the body as the first request kind it is valid for, in vLLM's order: chat
completion, completion for a generating model; embedding, classification, score, rerank, pooling for a pooling
model. A body no kind accepts is a 400; when one kind's distinctive field is there (``messages``, ``prompt``,
``input``, ...), its validation errors name the bad fields, else the message lists the kinds expected.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.http_errors import BadRequestError

Handler = Callable[[ServerContext, Any, Request], Awaitable[Response]]


async def _chat(ctx: ServerContext, body: Any, request: Request) -> Response:
    from vllite.plugins.openai_server.chat import create_chat_completion
    from vllite.plugins.openai_server.http_common import cancel_on_disconnect, data_parallel_rank_header, respond

    work = create_chat_completion(ctx, body, data_parallel_rank=data_parallel_rank_header(request))
    return respond(await cancel_on_disconnect(request, work))


async def _completion(ctx: ServerContext, body: Any, request: Request) -> Response:
    from vllite.plugins.openai_server.completions import create_completion
    from vllite.plugins.openai_server.http_common import cancel_on_disconnect, data_parallel_rank_header, respond

    work = create_completion(ctx, body, data_parallel_rank=data_parallel_rank_header(request))
    return respond(await cancel_on_disconnect(request, work))


def _pooling(name: str) -> Handler:
    async def run(ctx: ServerContext, body: Any, request: Request) -> Response:
        from vllite.plugins.openai_server.pooling import serving as pooling_serving
        from vllite.plugins.openai_server.pooling.routes import _answer

        create = getattr(pooling_serving, name)
        return await _answer(ctx, request, lambda: create(ctx, body))

    return run


def invocation_kinds(tasks: tuple[str, ...]) -> list[tuple[type, str, Handler]]:
    """The request kinds ``/invocations`` tries for a model with ``tasks``, in order: (model, distinctive field,
    handler)."""
    from vllite.plugins.openai_server.pooling.protocol import (
        ClassificationRequest,
        EmbeddingRequest,
        PoolingRequest,
        RerankRequest,
        ScoreRequest,
    )
    from vllite.plugins.openai_server.protocol import ChatCompletionRequest, CompletionRequest

    if "generate" in tasks:
        return [(ChatCompletionRequest, "messages", _chat), (CompletionRequest, "prompt", _completion)]
    return [
        (EmbeddingRequest, "input", _pooling("create_embedding")),
        (ClassificationRequest, "input", _pooling("create_classification")),
        (ScoreRequest, "text_1", _pooling("create_score")),
        (RerankRequest, "documents", _pooling("create_rerank")),
        (PoolingRequest, "input", _pooling("create_pooling")),
    ]


def sagemaker_router(ctx: ServerContext, dependencies: list[Any]) -> APIRouter:
    """``/ping`` (no key needed: it is a health probe) and ``/invocations`` (behind ``dependencies``)."""
    from vllite.plugins.openai_server.http_common import check_alive, health_response

    router = APIRouter()

    @router.get("/ping")
    @router.post("/ping")
    async def ping() -> Response:
        return health_response(ctx)

    @router.post("/invocations", dependencies=[Depends(dep) for dep in dependencies])
    async def invocations(request: Request) -> Response:
        body = await _json_body(request)
        check_alive(ctx)
        failures: list[tuple[str, pydantic.ValidationError]] = []
        for model, field, handler in _kinds(ctx):
            try:
                parsed = _adapter(model).validate_python(body)
            except pydantic.ValidationError as error:
                failures.append((field, error))
                continue
            return await handler(ctx, parsed, request)
        for field, failure in failures:  # the first kind the body looks like: its errors name the fields
            if isinstance(body, dict) and field in body:
                raise RequestValidationError(failure.errors())
        names = [model.__name__ for model, _, _ in _kinds(ctx)]
        raise BadRequestError(f"Cannot find suitable handler for request. Expected one of: {names}")

    return router


@functools.cache
def _adapter(model: type) -> pydantic.TypeAdapter[Any]:
    return pydantic.TypeAdapter(model)


def _kinds(ctx: ServerContext) -> list[tuple[type, str, Handler]]:
    return invocation_kinds(tuple(ctx.engine.engine_info.supported_tasks))


async def _json_body(request: Request) -> Any:
    import json

    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise BadRequestError(
            f"The request body must be JSON sent with 'Content-Type: application/json' (got {media_type or 'none'}).",
            param="Content-Type",
        )
    try:
        return json.loads(await request.body())
    except json.JSONDecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}.") from None
