"""vLLM's operations routes, served only in dev mode (``VLLITE_SERVER_DEV_MODE=1``, or vLLM's
``VLLM_SERVER_DEV_MODE=1``) and behind ``--api-key`` like every route; without the switch they do not exist (404).

=========================  ======  =================================================  ===============================
route                      method  input                                              answer
=========================  ======  =================================================  ===============================
``/sleep``                 POST    query ``level`` (0, 1, 2; default 1), ``mode``      200, empty
``/wake_up``               POST    query ``tags`` (repeated: weights, kv_cache)        200, empty
``/is_sleeping``           GET                                                        ``{"is_sleeping": bool}``
``/pause``                 POST    query ``mode`` (abort, wait, keep), ``clear_cache``  ``{"status": "paused"}``
``/resume``                POST                                                       ``{"status": "resumed"}``
``/is_paused``             GET                                                        ``{"is_paused": bool}``
``/reset_prefix_cache``    POST    query ``reset_running_requests``                    ``{"success": bool}``
``/start_profile``         POST                                                       200, empty
``/stop_profile``          POST                                                       200, empty
``/collective_rpc``        POST    ``{"method", "args", "kwargs", "timeout"}``          ``{"results": [...]}``
``/abort_requests``        POST    ``{"request_ids": [...]}`` (none: every request)    ``{"status": "aborted", ...}``
``/server_info``           GET     query ``config_format`` (text, json)               config, environment, system
=========================  ======  =================================================  ===============================

A bad query parameter or body field is a 400 naming it.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response
from pydantic import Field

from vllite.exceptions import UtilityCallError
from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.protocol import RequestModel

logger = logging.getLogger("vllite.server")

PauseModeParam = Literal["abort", "wait", "keep"]
WAKE_UP_TAGS = ("weights", "kv_cache")


class CollectiveRPCRequest(RequestModel):
    """``/collective_rpc``'s body: a worker method's name and its arguments (JSON values; nothing is unpickled)."""

    method: str = Field(min_length=1)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(default=None, gt=0)


class AbortRequestsRequest(RequestModel):
    """``/abort_requests``'s body: the ids to abort (a response's ``id`` aborts each of its prompts); none or an
    empty list aborts every request in flight."""

    request_ids: list[str] | None = None


def ops_router(ctx: ServerContext, dependencies: list[Any]) -> APIRouter:
    """The operations routes of the module docstring, behind ``dependencies`` (the API-key check)."""
    from vllite.plugins.openai_server.http_common import json_response

    router = APIRouter(dependencies=[Depends(dep) for dep in dependencies])
    engine = ctx.engine

    _add_sleep_and_pause_routes(router, ctx, json_response)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> Response:
        if reset_external:
            raise BadRequestError(
                "reset_external is not supported: vllite's KV connectors keep no prefix cache to reset.",
                param="reset_external",
            )
        return json_response({"success": bool(await engine.reset_prefix_cache(reset_running_requests))})

    @router.post("/start_profile")
    async def start_profile() -> Response:
        await _profile(engine, start=True)
        return Response(status_code=200)

    @router.post("/stop_profile")
    async def stop_profile() -> Response:
        await _profile(engine, start=False)
        return Response(status_code=200)

    @router.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRPCRequest) -> Response:
        try:
            results = await engine.collective_rpc(body.method, body.timeout, tuple(body.args), body.kwargs)
        except UtilityCallError as exc:
            if "no worker method" in str(exc) or "invalid arguments" in str(exc):
                raise BadRequestError(str(exc), param="method") from None
            raise
        # vLLM's answer: null, objects and arrays as they are, any other result as its string
        shown = [r if r is None or isinstance(r, (dict, list)) else str(r) for r in results]
        return json_response({"results": shown})

    @router.post("/abort_requests")
    async def abort_requests(body: AbortRequestsRequest) -> Response:
        in_flight = list(engine.output_processor.external_req_ids)
        if body.request_ids:
            wanted = set(body.request_ids)
            targets = [rid for rid in in_flight if rid in wanted or _prompt_parent(rid) in wanted]
            count = len(body.request_ids)
        else:
            targets = in_flight
            count = len(in_flight)
        if targets:
            await engine.abort(targets)
        return json_response({"status": "aborted", "aborted": count})

    @router.get("/server_info")
    async def server_info(config_format: Literal["text", "json"] = "text") -> Response:
        from vllite.plugins.openai_server.ops.info import server_info as describe

        return json_response(describe(engine.config, config_format, getattr(engine, "engine_info", None)))

    return router


def _add_sleep_and_pause_routes(router: APIRouter, ctx: ServerContext, json_response: Any) -> None:
    """``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/pause``, ``/resume`` and ``/is_paused`` on ``router``."""
    engine = ctx.engine

    @router.post("/sleep")
    async def sleep(level: Annotated[int, Query(ge=0, le=2)] = 1, mode: PauseModeParam = "abort") -> Response:
        logger.info("Putting the engine to sleep (level %d, mode %s)", level, mode)
        await engine.sleep(level, mode)
        if ctx.metrics is not None:
            ctx.metrics.record_sleep_state(level)
        return Response(status_code=200)

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
        unknown = sorted(set(tags or ()) - set(WAKE_UP_TAGS))
        if unknown:
            raise BadRequestError(f"Unknown wake_up tags {unknown}; known: {', '.join(WAKE_UP_TAGS)}.", param="tags")
        logger.info("Waking the engine up (tags %s)", tags or "all")
        await engine.wake_up(tags or None)
        if ctx.metrics is not None and not await engine.is_sleeping():
            ctx.metrics.record_sleep_state(0)
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return json_response({"is_sleeping": bool(await engine.is_sleeping())})

    @router.post("/pause")
    async def pause(
        mode: PauseModeParam = "abort", wait_for_inflight_requests: bool = False, clear_cache: bool = True
    ) -> Response:
        if wait_for_inflight_requests:  # vLLM's older spelling of mode=wait
            mode = "wait"
        await engine.pause_generation(mode, clear_cache)
        return json_response({"status": "paused"})

    @router.post("/resume")
    async def resume() -> Response:
        try:
            await engine.resume_generation()
        except UtilityCallError as exc:
            if "engine is asleep" not in str(exc):
                raise
            raise BadRequestError(str(exc).split("failed: ", 1)[-1]) from None
        return json_response({"status": "resumed"})

    @router.get("/is_paused")
    async def is_paused() -> Response:
        return json_response({"is_paused": await engine.is_paused()})


_PROMPT_SUFFIX = re.compile(r"-\d+$")


def _prompt_parent(request_id: str) -> str:
    """The response id of a prompt's engine request (``{id}-{prompt index}``)."""
    return _PROMPT_SUFFIX.sub("", request_id)


async def _profile(engine: Any, *, start: bool) -> None:
    """Starts or stops the engine's profiler; a profiler that is off, or already in that state, is a 400."""
    try:
        await (engine.start_profile() if start else engine.stop_profile())
    except UtilityCallError as exc:
        message = str(exc)
        if "profiler is" in message.lower():  # off, already running, not running: the caller's to fix
            raise BadRequestError(message.split("failed: ", 1)[-1], param="profiler") from None
        raise
