"""``/v1/responses``: OpenAI's Responses API over the chat machinery.

- ``POST /v1/responses``: a reply to ``input`` (a text or items) after ``instructions``, whole, streamed
  (``stream``) or in the background (``background``, polled with ``GET``). The items become chat messages
  (:mod:`~vllite.plugins.openai_server.responses_api.input`) rendered by the chat template; the reply is split by the
  server's ``--reasoning-parser`` (a ``reasoning`` item) and ``--tool-call-parser`` (``function_call`` items), the rest
  is a ``message`` item. ``text.format`` (``json_schema``, ``json_object``) constrains the reply through structured
  outputs, as ``response_format`` does on the chat route. ``previous_response_id`` continues a stored response: its
  conversation (input and output items) comes before ``input``; its ``instructions`` do not carry over.
- ``GET /v1/responses/{id}``: a stored response (``store: true``, the default); ``DELETE`` forgets it.
- ``POST /v1/responses/{id}/cancel``: stops a background response still queued or in progress (aborting it in the
  engine); any other response is a 400, as in vLLM.

Unknown response ids are 404 (``param: previous_response_id`` when the request names one).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import TypeAdapter

from vllite.plugins.openai_server.chat import ChatRun, start_chat
from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.errors import check_sample, error_response
from vllite.plugins.openai_server.event_stream import EventStream, EventStreamResponse
from vllite.plugins.openai_server.http_errors import BadRequestError, ResponseNotFoundError
from vllite.plugins.openai_server.protocol import random_id
from vllite.plugins.openai_server.responses import now
from vllite.plugins.openai_server.responses_api.input import input_items, to_chat_request, to_messages
from vllite.plugins.openai_server.responses_api.protocol import InputItem, OutputItem, ResponseObject, ResponsesRequest
from vllite.plugins.openai_server.responses_api.store import ResponseStore, StoredResponse
from vllite.plugins.openai_server.responses_api.stream import (
    OutputBuilder,
    StreamParts,
    count_reasoning_tokens,
    make_usage,
    stream_events,
)

#: Chat-route field names in a 400, as the Responses request calls them.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
           "response_format": "text", "prompt": "input"}  # fmt: skip
_ITEM: TypeAdapter[InputItem] = TypeAdapter(InputItem)
_ACTIVE = ("queued", "in_progress")


@dataclass
class Prepared:
    """One Responses request, submitted through the chat machinery."""

    request: ResponsesRequest
    run: ChatRun
    items: list[Any]  # the conversation so far: the previous response's, then this input
    created_at: int
    temperature: float | None
    top_p: float | None

    @property
    def response_id(self) -> str:
        """The response's id (also its engine request's)."""
        return self.run.request_id

    def snapshot(self, status: str, output: list[OutputItem] | None = None) -> ResponseObject:
        """The response object with ``status`` and ``output``, echoing the request's settings."""
        r = self.request
        fmt = r.text.format if r.text is not None else None
        choice = r.tool_choice
        return ResponseObject(
            id=self.response_id,
            model=self.run.model,
            status=status,  # type: ignore[arg-type]
            output=list(output or []),
            created_at=self.created_at,
            background=r.background,
            instructions=r.instructions,
            max_output_tokens=r.max_output_tokens,
            max_tool_calls=r.max_tool_calls,
            metadata=dict(r.metadata or {}),
            parallel_tool_calls=r.parallel_tool_calls,
            previous_response_id=r.previous_response_id,
            reasoning=r.reasoning,
            service_tier=r.service_tier or "auto",
            store=r.store,
            temperature=self.temperature,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            tool_choice=choice.model_dump() if choice is not None and not isinstance(choice, str) else choice or "auto",
            tools=[tool.model_dump() for tool in r.tools or []],
            top_p=self.top_p,
            truncation=r.truncation or "disabled",
            user=r.user,
        )


async def start_response(
    ctx: ServerContext, store: ResponseStore, request: ResponsesRequest, *, data_parallel_rank: int | None = None
) -> Prepared:
    """Checks ``request``, renders its conversation and submits it. Raises ``BadRequestError`` (400) naming the
    Responses field, or :class:`ResponseNotFoundError` (404) for an unknown ``previous_response_id``."""
    _check_supported(request)
    previous: list[Any] = []
    if request.previous_response_id is not None:
        entry = store.get(request.previous_response_id, param="previous_response_id")
        if entry.response.status in _ACTIVE:
            raise BadRequestError(
                f"Response {request.previous_response_id!r} is still {entry.response.status}: wait until it ends.",
                param="previous_response_id",
            )
        previous = entry.items
    items = [*previous, *input_items(request)]
    response_id = random_id("resp_")
    try:
        messages = to_messages(request.instructions, items, len(previous))
        chat = to_chat_request(request, messages, stream=request.stream, request_id=response_id)
        run = await start_chat(ctx, chat, data_parallel_rank=data_parallel_rank)
    except BadRequestError as exc:
        raise _renamed(exc) from None
    defaults = ctx.model_defaults
    temperature = chat.temperature if chat.temperature is not None else defaults.get("temperature", 1.0)
    top_p = chat.top_p if chat.top_p is not None else defaults.get("top_p", 1.0)
    return Prepared(request, run, items, now(), temperature, top_p)


def _check_supported(request: ResponsesRequest) -> None:
    if request.top_logprobs:
        raise BadRequestError("top_logprobs is not supported on /v1/responses.", param="top_logprobs")
    if request.background and request.stream:
        raise BadRequestError(
            "background responses cannot be streamed here: poll GET /v1/responses/{id}.", param="stream"
        )
    if request.background and not request.store:
        raise BadRequestError(
            "background needs store: true (the response is polled from the store).", param="background"
        )


def _renamed(exc: BadRequestError) -> BadRequestError:
    """``exc`` naming the Responses field where the chat machinery named its own."""
    param = _PARAMS.get(exc.param or "", exc.param)
    message = str(exc)
    if exc.param in ("max_tokens", "max_completion_tokens"):
        message = message.replace(exc.param, "max_output_tokens")
    return BadRequestError(message, param=param)


async def create_response(
    ctx: ServerContext, store: ResponseStore, request: ResponsesRequest, *, data_parallel_rank: int | None = None
) -> ResponseObject | EventStream:
    """The response, its events (``stream``), or its queued snapshot (``background``)."""
    prep = await start_response(ctx, store, request, data_parallel_rank=data_parallel_rank)
    submitted = prep.run.submitted
    if request.background:
        return _start_background(ctx, store, prep)
    if request.stream:
        extractor = prep.run.reasoning.wrap(prep.run.mode.stream())
        parts = StreamParts(extractor, prep.snapshot, functools.partial(_finished, ctx, store, prep))
        return EventStream(stream_events(parts, submitted.outputs()), submitted.abort_unfinished)
    return await _collect(ctx, store, prep)


async def _collect(ctx: ServerContext, store: ResponseStore, prep: Prepared) -> ResponseObject:
    submitted, run = prep.run.submitted, prep.run
    final = None
    try:
        async for _, output in submitted.outputs():
            final = output
    finally:
        await submitted.abort_unfinished()
    assert final is not None
    sample = final.outputs[0]
    check_sample(sample)
    thought, answer = run.reasoning.split(sample.text)
    content, calls = run.mode.extract(answer)
    builder = OutputBuilder()
    builder.reasoning(thought or "")
    builder.text(content or "")
    for call in calls:
        builder.call(call.id, call.function.name, call.function.arguments)
    items = builder.finish(incomplete=sample.finish_reason == "length")
    return _finished(ctx, store, prep, items, list(sample.token_ids), final)


def _finished(
    ctx: ServerContext, store: ResponseStore, prep: Prepared, items: list[OutputItem], token_ids: list[int], final: Any
) -> ResponseObject:
    """The finished response (``incomplete`` when cut by ``max_output_tokens``), stored unless ``store: false``."""
    incomplete = final.outputs[0].finish_reason == "length"
    response = prep.snapshot("incomplete" if incomplete else "completed", items)
    reasoning_tokens = count_reasoning_tokens(ctx.tokenizer, prep.run.reasoning.parser, token_ids, items)
    response.usage = make_usage(len(prep.run.prompt_ids), len(token_ids), final.num_cached_tokens, reasoning_tokens)
    if incomplete:
        response.incomplete_details = {"reason": "max_output_tokens"}
    else:
        response.completed_at = now()
    if prep.request.store:
        conversation = [*prep.items, *(_ITEM.validate_python(msgspec.to_builtins(item)) for item in items)]
        store.put(StoredResponse(response, conversation))
    return response


def _start_background(ctx: ServerContext, store: ResponseStore, prep: Prepared) -> ResponseObject:
    """Stores the response as queued and runs it in a task; returns the queued snapshot."""
    queued = prep.snapshot("queued")
    entry = StoredResponse(queued, list(prep.items))
    store.put(entry)

    async def run() -> None:
        entry.response = prep.snapshot("in_progress")
        try:
            await _collect(ctx, store, prep)  # stores the finished response in place of this entry
        except asyncio.CancelledError:
            entry.response = msgspec.structs.replace(entry.response, status="cancelled")
            raise
        except Exception as exc:
            failed = prep.snapshot("failed")
            failed.error = {"code": "server_error", "message": str(exc)}
            entry.response = failed

    def ended(task: asyncio.Task) -> None:
        store.running.discard(task)
        if task.cancelled():  # also before it ever ran: abort the engine request it would have read
            aborting = asyncio.ensure_future(prep.run.submitted.abort_unfinished())
            store.running.add(aborting)
            aborting.add_done_callback(store.running.discard)

    entry.task = asyncio.ensure_future(run())
    store.running.add(entry.task)  # a strong reference until it ends
    entry.task.add_done_callback(ended)
    return queued


async def cancel_response(store: ResponseStore, response_id: str) -> ResponseObject:
    """Cancels a background response still queued or in progress; 400 for any other."""
    entry = store.get(response_id)
    status = entry.response.status
    if status not in _ACTIVE or entry.task is None:
        raise BadRequestError(
            f"Cannot cancel response {response_id!r}: it is {status}, and only a background response still queued or "
            "in progress can be cancelled.",
            param="response_id",
        )
    entry.response = msgspec.structs.replace(entry.response, status="cancelled")
    entry.task.cancel()
    await asyncio.wait([entry.task])  # its engine request is aborted once it ends
    return entry.response


def add_responses_routes(router: APIRouter, ctx: ServerContext) -> ResponseStore:
    """Adds the ``/responses`` routes to the ``/v1`` router (its API-key check included); returns their store."""
    from vllite.plugins.openai_server.http_common import cancel_on_disconnect, data_parallel_rank_header, json_response

    store = ResponseStore()

    def not_found(exc: ResponseNotFoundError) -> Response:
        return json_response(error_response(404, str(exc), exc.param), 404)

    @router.post("/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        if ctx.engine.errored:
            raise ctx.engine.dead_error
        rank = data_parallel_rank_header(request)
        try:
            result = await cancel_on_disconnect(request, create_response(ctx, store, body, data_parallel_rank=rank))
        except ResponseNotFoundError as exc:
            return not_found(exc)
        if isinstance(result, Response):
            return result
        return EventStreamResponse(result) if isinstance(result, EventStream) else json_response(result)

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        try:
            return json_response(store.get(response_id).response)
        except ResponseNotFoundError as exc:
            return not_found(exc)

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        try:
            store.delete(response_id)
        except ResponseNotFoundError as exc:
            return not_found(exc)
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    @router.post("/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Response:
        try:
            return json_response(await cancel_response(store, response_id))
        except ResponseNotFoundError as exc:
            return not_found(exc)

    return store
