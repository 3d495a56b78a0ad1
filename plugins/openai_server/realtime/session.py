"""``/v1/realtime``: the text subset of OpenAI's Realtime API over a WebSocket, one session per connection.

A connection is one engine session (a resumable request, ``AsyncLLM.generate`` over ``StreamingInput`` chunks):
``conversation.item.create`` appends a message's text to the pending input, ``response.create`` sends the pending
input as the session's next chunk and streams the turn it starts (``response.created`` ... ``response.done`` with
its usage). The engine keeps the session's KV between turns, so a turn prefills only what is new. The connection
closing aborts the session and frees its KV. See ``docs/sessions.md`` ("Realtime API") for the events, and what
``response.cancel`` does (the engine cannot stop a turn and keep the session: the turn finishes unseen).

``realtime_router(ctx)`` serves it; the route takes ``Authorization: Bearer <--api-key>`` like every other route.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import Response

from vllite.engine.sessions import StreamingInput
from vllite.exceptions import VlliteError
from vllite.outputs import RequestOutput
from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.errors import error_response
from vllite.plugins.openai_server.realtime.protocol import (
    FINISH_STATUS,
    ItemCreate,
    RealtimeEventError,
    ResponseCancel,
    ResponseConfig,
    ResponseCreate,
    SessionUpdate,
    error_event,
    message_item,
    new_id,
    parse_client_event,
    server_event,
    session_object,
    usage,
)
from vllite.plugins.openai_server.realtime.sampling import turn_sampling_params
from vllite.plugins.openai_server.realtime.turns import Turn
from vllite.plugins.openai_server.responses import encode

logger = logging.getLogger("vllite.server")

#: What separates the session's ``instructions`` from the first response's input (both are plain text).
INSTRUCTIONS_SEPARATOR = "\n\n"
#: The close code of a connection refused after the handshake (an unknown model): "policy violation".
POLICY_VIOLATION = 1008


def realtime_router(ctx: ServerContext) -> APIRouter:
    """``/v1/realtime`` (WebSocket) for ``ctx``'s engine."""
    router = APIRouter(prefix="/v1")

    @router.websocket("/realtime")
    async def realtime(websocket: WebSocket) -> None:
        if not _authorized(ctx, websocket):
            await _deny(websocket, "Invalid or missing API key: send 'Authorization: Bearer <key>'.")
            return
        await websocket.accept()
        await RealtimeConnection(ctx, websocket).run()

    return router


def _authorized(ctx: ServerContext, websocket: WebSocket) -> bool:
    key = ctx.settings.api_key
    if key is None:
        return True
    scheme, _, token = websocket.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


async def _deny(websocket: WebSocket, message: str) -> None:
    """Refuses the handshake with a 401 carrying OpenAI's error body (a bare 403 where the server cannot)."""
    try:
        body = encode(error_response(401, message))
        await websocket.send_denial_response(Response(body, status_code=401, media_type="application/json"))
    except RuntimeError:  # no WebSocket Denial Response extension
        await websocket.close(code=POLICY_VIOLATION)


class RealtimeConnection:
    """One WebSocket connection: its session settings, the pending input, the engine session and its turn.

    The reader (``run``) handles client events one at a time; a pump task streams the engine session's outputs. Both
    send through one lock. At most one turn runs at a time, so every output belongs to ``self.turn``.
    """

    def __init__(self, ctx: ServerContext, websocket: WebSocket) -> None:
        self.ctx = ctx
        self.websocket = websocket
        self.session_id = new_id("sess_")
        self.conversation_id = new_id("conv_")
        self.model = ctx.model_name
        self.lora: Any = None
        self.settings: dict[str, Any] = {"instructions": None, "max_output_tokens": None, "temperature": None}
        self.pending: list[str] = []  # the texts of the items added since the last response
        self.item_ids: set[str] = set()
        self.last_item_id: str | None = None
        self.turn: Turn | None = None
        self.context_len = 0  # tokens the session's context holds after its last turn
        self.ended: str | None = None  # why the engine session is over, once it is
        self._chunks: asyncio.Queue[StreamingInput] = asyncio.Queue()
        self._pump: asyncio.Task | None = None
        self._send_lock = asyncio.Lock()
        self._closed = False

    @property
    def started(self) -> bool:
        """Whether the engine session exists (its first response was created)."""
        return self._pump is not None

    # ------------------------------------------------------------------ the connection
    async def run(self) -> None:
        """Serves the connection until the client leaves; then aborts the session (freeing its KV)."""
        try:
            self.model, self.lora = await self.ctx.resolve_model(self.websocket.query_params.get("model"))
            if self.ctx.tokenizer is None:
                raise VlliteError("The realtime API needs a tokenizer; this server runs with --skip-tokenizer-init.")
        except (VlliteError, ValueError) as exc:
            await self.send(error_event(str(exc), code="invalid_model", kind="invalid_request_error"))
            await self.websocket.close(code=POLICY_VIOLATION)
            return
        await self.send(server_event("session.created", session=self._session()))
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                await self._on_message(message)
        finally:
            await self._abort()

    async def send(self, event: dict[str, Any]) -> None:
        """Sends one server event; a connection the client has left takes nothing more (the reader sees it go)."""
        if self._closed:
            return
        async with self._send_lock:
            try:
                await self.websocket.send_text(json.dumps(event))
            except (WebSocketDisconnect, RuntimeError, OSError) as exc:  # closed under us
                logger.debug("Realtime session %s: the client left (%s).", self.session_id, exc)
                self._closed = True

    async def _abort(self) -> None:
        self._closed = True
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()  # closes the generate() stream: the engine aborts the session
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump

    async def _on_message(self, message: Mapping[str, Any]) -> None:
        raw = message.get("text")
        if raw is None and message.get("bytes") is not None:
            raw = message["bytes"].decode("utf-8", errors="replace")
        try:
            data = json.loads(raw or "")
        except ValueError as exc:
            await self.send(
                error_event(RealtimeEventError(f"The message is not valid JSON: {exc}.", code="invalid_json"))
            )
            return
        try:
            event = parse_client_event(data)
            if isinstance(event, SessionUpdate):
                await self._update_session(event)
            elif isinstance(event, ItemCreate):
                await self._create_item(event)
            elif isinstance(event, ResponseCreate):
                await self._create_response(event)
            else:
                self._cancel_response(event)
        except RealtimeEventError as exc:
            if exc.event_id is None and isinstance(data, dict) and isinstance(data.get("event_id"), str):
                exc.event_id = data["event_id"]
            await self.send(error_event(exc))

    def _session(self) -> dict[str, Any]:
        return session_object(self.session_id, self.model, self.settings)

    # ------------------------------------------------------------------ client events
    async def _update_session(self, event: SessionUpdate) -> None:
        update = event.session
        if update.model is not None and update.model != self.model:
            raise RealtimeEventError(
                f"The model of a session cannot change (it is {self.model!r}).",
                code="invalid_value",
                param="session.model",
            )
        if update.instructions is not None and self.started:
            raise RealtimeEventError(
                "instructions open the session's context: they cannot change after its first response.",
                code="invalid_value",
                param="session.instructions",
            )
        for name in ("instructions", "max_output_tokens", "temperature"):
            if name in update.model_fields_set:
                self.settings[name] = getattr(update, name)
        await self.send(server_event("session.updated", session=self._session()))

    async def _create_item(self, event: ItemCreate) -> None:
        self._check_open()
        item = event.item
        if event.previous_item_id not in (None, self.last_item_id):
            raise RealtimeEventError(
                f"Items can only be appended to the end of the conversation (after {self.last_item_id!r}).",
                code="invalid_value",
                param="previous_item_id",
            )
        allowed = ("output_text", "text") if item.role == "assistant" else ("input_text",)
        for index, part in enumerate(item.content):
            if part.type not in allowed:
                raise RealtimeEventError(
                    f"Content of type {part.type!r} is not supported in a {item.role} message here; "
                    f"use {' or '.join(allowed)} (this server serves text only).",
                    code="invalid_value",
                    param=f"item.content[{index}].type",
                )
            if part.text is None:
                raise RealtimeEventError(
                    f"A {part.type} part needs its text.", code="invalid_value", param=f"item.content[{index}].text"
                )
        item_id = item.id or new_id("item_")
        if item_id in self.item_ids:
            raise RealtimeEventError(f"Item {item_id!r} already exists.", code="invalid_value", param="item.id")
        self.item_ids.add(item_id)
        self.pending.append("".join(part.text or "" for part in item.content))
        previous, self.last_item_id = self.last_item_id, item_id
        content = [{"type": part.type, "text": part.text} for part in item.content]
        stored = message_item(item_id, item.role, content, "completed")
        await self.send(server_event("conversation.item.added", previous_item_id=previous, item=stored))
        await self.send(server_event("conversation.item.done", previous_item_id=previous, item=stored))

    async def _create_response(self, event: ResponseCreate) -> None:
        self._check_open()
        if self.ctx.engine.errored:
            raise RealtimeEventError("The engine is not available.", code="server_error")
        if self.turn is not None:
            raise RealtimeEventError(
                f"Response {self.turn.response_id!r} is still in progress: wait for its response.done"
                + (" (it was cancelled and is finishing)." if self.turn.cancelled else "."),
                code="conversation_already_has_active_response",
            )
        config = event.response or ResponseConfig()
        text = self._next_input(config)
        chunk_tokens = self.ctx.tokenizer.encode(text, add_special_tokens=not self.started)
        room = self.ctx.max_model_len - (self.context_len + len(chunk_tokens))
        if room < 1:
            self.pending.clear()  # else every later response would be refused too
            raise RealtimeEventError(
                f"The conversation would hold {self.context_len + len(chunk_tokens)} tokens with this input, leaving "
                f"no room to answer within max_model_len ({self.ctx.max_model_len}): the pending input is dropped.",
                code="context_length_exceeded",
            )
        limit = config.max_output_tokens or self.settings["max_output_tokens"] or "inf"
        temperature = config.temperature if config.temperature is not None else self.settings["temperature"]
        try:
            params = turn_sampling_params(self.ctx.model_defaults, limit, room, temperature)
        except ValueError as exc:
            raise RealtimeEventError(str(exc), code="invalid_value", param="response") from None
        self.pending.clear()
        turn = Turn(new_id("resp_"), new_id("item_"), self.last_item_id, self.conversation_id, limit, config.metadata)
        self.turn, self.last_item_id = turn, turn.item_id
        self.item_ids.add(turn.item_id)
        for opening in turn.opening_events():
            await self.send(opening)
        self.ctx.log_prompt(self.session_id, text, params)
        await self._chunks.put(StreamingInput(text, params))
        if self._pump is None:
            stream = self.ctx.engine.generate(self._inputs(), None, self.session_id, lora_request=self.lora)
            self._pump = asyncio.create_task(self._stream(stream), name=f"vllite-realtime-{self.session_id}")

    def _next_input(self, config: ResponseConfig) -> str:
        """The next chunk's text: the pending items' texts, after the instructions on the first response."""
        if config.instructions is not None and self.started:
            raise RealtimeEventError(
                "instructions open the session's context: a later response cannot set them.",
                code="invalid_value",
                param="response.instructions",
            )
        text = "".join(self.pending)
        if self.started:
            return text
        instructions = config.instructions if config.instructions is not None else self.settings["instructions"]
        if instructions:
            text = instructions + INSTRUCTIONS_SEPARATOR + text if text else instructions
        if not text:
            raise RealtimeEventError(
                "The first response needs input: add a conversation item (or instructions) first.",
                code="invalid_value",
                param="item",
            )
        return text

    def _cancel_response(self, event: ResponseCancel) -> None:
        turn = self.turn
        if turn is None:
            raise RealtimeEventError("There is no response in progress to cancel.", code="response_cancel_not_active")
        if event.response_id not in (None, turn.response_id):
            raise RealtimeEventError(
                f"Response {event.response_id!r} is not in progress (response {turn.response_id!r} is).",
                code="invalid_value",
                param="response_id",
            )
        turn.cancelled = True  # its text stops streaming; response.done (cancelled) comes when the engine ends it

    def _check_open(self) -> None:
        if self.ended is not None:
            raise RealtimeEventError(f"{self.ended} Open a new connection for a new session.", code="session_ended")

    # ------------------------------------------------------------------ the engine session
    async def _inputs(self) -> AsyncGenerator[StreamingInput, None]:
        """The session's input chunks; the stream is cancelled (never ended) when the connection goes."""
        while True:
            yield await self._chunks.get()

    async def _stream(self, stream: AsyncIterator[RequestOutput]) -> None:
        """Turns the session's outputs into events until it ends (or the connection goes and cancels this)."""
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for output in stream:
                    await self._on_output(output)
            if self.turn is not None:
                await self._fail("The session ended before its response finished.")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.info("Realtime session %s failed: %s: %s", self.session_id, type(exc).__name__, exc)
            await self._fail(f"The session failed: {exc}")
        self.ended = self.ended or "The session has ended."

    async def _on_output(self, output: RequestOutput) -> None:
        turn = self.turn
        sample = output.outputs[0] if output.outputs else None
        if turn is None or sample is None:
            if output.finished:
                self.ended = "The session has ended."
            return
        turn.text.append(sample.text)
        turn.num_tokens += len(sample.token_ids)
        if sample.text and not turn.cancelled:
            await self.send(turn.delta_event(sample.text))
        if sample.finish_reason is None:
            return
        input_tokens = len(output.prompt_token_ids or ())
        self.context_len = input_tokens + turn.num_tokens
        if output.finished:  # the engine ended the session with this turn
            full = self.context_len >= self.ctx.max_model_len
            self.ended = (
                f"The session's context is full (max_model_len {self.ctx.max_model_len})."
                if full
                else f"The session ended in the engine (finish reason {sample.finish_reason!r})."
            )
        details: dict[str, Any] | None
        if sample.finish_reason == "error":
            status, details = "failed", {"type": "failed", "error": {"type": "server_error", "message": sample.error}}
        elif turn.cancelled:
            status, details = "cancelled", {"type": "cancelled", "reason": "client_cancelled"}
        else:
            status, details = FINISH_STATUS.get(sample.finish_reason, ("completed", None))
        await self._finish(turn, status, details, usage(input_tokens, output.num_cached_tokens, turn.num_tokens))

    async def _fail(self, message: str) -> None:
        self.ended = message
        turn = self.turn
        if turn is not None:
            details = {"type": "failed", "error": {"type": "server_error", "message": message}}
            await self._finish(turn, "failed", details, None)
        await self.send(error_event(message))

    async def _finish(self, turn: Turn, status: str, details: dict | None, turn_usage: dict | None) -> None:
        """Closes the response; the turn is over (another may start) before its ``response.done`` goes."""
        *events, done = turn.closing_events(status, details, turn_usage)
        for event in events:
            await self.send(event)
        self.turn = None
        await self.send(done)
