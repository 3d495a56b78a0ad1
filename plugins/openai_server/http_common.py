"""The HTTP helpers every router of the server shares: JSON bodies, the API-key check, cancelling on disconnect,
the engine-alive check, the data-parallel rank header, ``/health`` and validation-error messages.

``app.py`` and every router import these downward; no router imports ``app.py``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.errors import UnauthorizedError, error_response
from vllite.plugins.openai_server.event_stream import EventStream, EventStreamResponse
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.responses import encode

JSON = "application/json"


def json_response(body: Any, status: int = 200) -> Response:
    return Response(content=encode(body), status_code=status, media_type=JSON)


def api_key_check(ctx: ServerContext) -> Callable[[Request], Awaitable[None]]:
    """The dependency that requires ``Authorization: Bearer <--api-key>`` (nothing without ``--api-key``)."""

    async def check_api_key(request: Request) -> None:
        key = ctx.settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise UnauthorizedError("Invalid or missing API key: send 'Authorization: Bearer <key>'.")

    return check_api_key


def describe_validation_error(exc: RequestValidationError, content_type: str | None = None) -> tuple[str, str | None]:
    """One message naming every bad field, and the first field's name (OpenAI's ``param``); a body that is not
    JSON (malformed, or sent without ``Content-Type: application/json``) is one message saying so."""
    body_error = _body_error(exc.errors(), content_type)
    if body_error is not None:
        return body_error, None
    parts, params = [], []
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ())]
        if loc and loc[0] in _PARAM_SOURCES:  # where the parameter came from: the name alone is OpenAI's param
            loc = loc[1:]
        field = ".".join(loc)
        kind = error.get("type", "")
        if kind == "extra_forbidden":
            parts.append(f"Unknown field {field!r}: not an OpenAI or supported vLLM parameter.")
        elif kind == "missing":
            parts.append(f"Missing required field {field!r}.")
        else:
            shown = repr(error.get("input"))[:80]
            parts.append(f"{field or 'body'}: {error.get('msg', 'invalid value')} (got {shown}).")
        if field:
            params.append(loc[0])
    # A union type reports every branch it tried: keep the messages short and distinct.
    unique = list(dict.fromkeys(parts))
    message = " ".join(unique[:4]) + (f" (and {len(unique) - 4} more)" if len(unique) > 4 else "")
    return message, params[0] if params else None


_PARAM_SOURCES = ("body", "query", "path", "header", "cookie")


def _body_error(errors: Sequence[Any], content_type: str | None) -> str | None:
    """The message for a body that could not be read as JSON at all, else None."""
    for error in errors:
        if error.get("type") == "json_invalid":  # loc: ("body", character offset)
            loc = error.get("loc", ())
            where = f" at character {loc[1]}" if len(loc) > 1 else ""
            reason = (error.get("ctx") or {}).get("error") or error.get("msg", "JSON decode error")
            return f"The request body is not valid JSON: {reason}{where}."
    media_type = (content_type or "").split(";")[0].strip().lower()
    is_json = media_type == "application/json" or media_type.endswith("+json")
    if not is_json and any(tuple(error.get("loc", ())) == ("body",) for error in errors):
        # FastAPI reads the body as JSON only under a JSON content type; otherwise it is bytes, "not an object".
        return (
            "The request body must be JSON sent with 'Content-Type: application/json' "
            f"(got Content-Type: {content_type or 'none'})."
        )
    return None


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Runs ``work``; cancels it (aborting its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Let the cancellation run to its end (the work's cleanup aborts its engine requests) before the task
            # is read; asyncio.wait neither raises the work's error nor hides a cancellation of this coroutine.
            await asyncio.wait({task})
    left = watcher.done() and not watcher.cancelled() and watcher.exception() is None
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    if left and task.exception() is None and isinstance(task.result(), EventStream):
        await task.result().close()  # the client left between submitting and streaming
    if left:
        return Response(status_code=499)  # whatever the work ended with, nobody reads it
    return task.result()


def respond(result: Any) -> Response:
    """``result`` as a response: a ``Response`` as is, an event stream streamed, anything else as JSON."""
    if isinstance(result, Response):
        return result
    if isinstance(result, EventStream):
        return EventStreamResponse(result)
    return json_response(result)


#: vLLM's header naming the data-parallel engine a request must go to.
DP_RANK_HEADER = "X-data-parallel-rank"


def data_parallel_rank_header(request: Request) -> int | None:
    """The engine rank the ``X-data-parallel-rank`` header names (None without the header)."""
    value = request.headers.get(DP_RANK_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequestError(f"{DP_RANK_HEADER} must be an integer, got {value!r}.", param=DP_RANK_HEADER) from None


def check_alive(ctx: ServerContext) -> None:
    """Raises the engine's death error if it died: a route answers at once instead of queueing."""
    if ctx.engine.errored:
        raise ctx.engine.dead_error


def health_response(ctx: ServerContext) -> Response:
    """``/health`` (and ``/ping``): an empty 200 while the engine runs, else a 503."""
    if ctx.engine.errored or not ctx.engine.is_running:
        return json_response(error_response(503, "The engine is dead or shut down."), 503)
    return Response(status_code=200)
