"""The Anthropic routes' HTTP side: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` with Anthropic's
authentication headers and error shape.

With ``--api-key``, a request must carry the key in ``x-api-key`` (what the ``anthropic`` client sends) or in
``Authorization: Bearer``. Every failure is Anthropic's error object (``{"type": "error", "error": {"type",
"message"}}``): 400 ``invalid_request_error``, 401 ``authentication_error``, 404 ``not_found_error``, 500
``api_error``. As on the OpenAI routes, a client that disconnects aborts its request in the engine at once.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from vllite.plugins.openai_server.anthropic.messages import count_tokens, create_message
from vllite.plugins.openai_server.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    describe_validation_error,
    encode,
    error_body,
)
from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.errors import classify
from vllite.plugins.openai_server.event_stream import EventStream, EventStreamResponse
from vllite.plugins.openai_server.http_errors import BadRequestError, UnauthorizedError

Body = TypeVar("Body", bound=BaseModel)


def anthropic_router(ctx: ServerContext) -> APIRouter:
    """The routes of Anthropic's Messages API, answering as Anthropic does (see the module docstring)."""
    from vllite.plugins.openai_server.http_common import cancel_on_disconnect, data_parallel_rank_header

    router = APIRouter(prefix="/v1")

    @router.post("/messages")
    async def messages(request: Request) -> Response:
        async def work() -> Any:
            body = await read_body(request, MessagesRequest)
            check_alive(ctx)
            rank = data_parallel_rank_header(request)
            return await cancel_on_disconnect(request, create_message(ctx, body, data_parallel_rank=rank))

        return await _answer(ctx, request, work)

    @router.post("/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        async def work() -> Any:
            return await count_tokens(ctx, await read_body(request, CountTokensRequest))

        return await _answer(ctx, request, work)

    return router


async def _answer(ctx: ServerContext, request: Request, work: Callable[[], Awaitable[Any]]) -> Response:
    """Checks the key, runs ``work`` and answers with its result, or with the error it raised in Anthropic's shape."""
    try:
        check_api_key(ctx, request)
        result = await work()
    except Exception as exc:
        status, body = classify(exc)
        return anthropic_error(status, body.error.message)
    if isinstance(result, Response):
        return result
    if isinstance(result, EventStream):
        return EventStreamResponse(result)
    return Response(content=encode(result), media_type="application/json")


def anthropic_error(status: int, message: str) -> Response:
    """An error response in Anthropic's shape."""
    return Response(content=encode(error_body(status, message)), status_code=status, media_type="application/json")


def check_api_key(ctx: ServerContext, request: Request) -> None:
    """:class:`UnauthorizedError` unless the request carries the server's ``--api-key`` (if it has one) in
    ``x-api-key`` or ``Authorization: Bearer``."""
    key = ctx.settings.api_key
    if key is None:
        return
    given = [request.headers.get("x-api-key", "")]
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        given.append(token.strip())
    if not any(secrets.compare_digest(candidate.encode(), key.encode()) for candidate in given):
        raise UnauthorizedError("Invalid or missing API key: send 'x-api-key: <key>' or 'Authorization: Bearer <key>'.")


async def read_body(request: Request, model: type[Body]) -> Body:
    """The request's JSON body as ``model``; :class:`BadRequestError` naming each bad field."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise BadRequestError(describe_validation_error(exc)) from None


def check_alive(ctx: ServerContext) -> None:
    if ctx.engine.errored:
        raise ctx.engine.dead_error
