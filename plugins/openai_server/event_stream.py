"""A Server-Sent Events response that notices a client leaving at once, and always cleans up after itself.

Starlette's ``StreamingResponse`` (ASGI 2.4) notices a disconnect only when its next write fails, which can be
a long wait while a request sits in the engine's queue, and it never runs the cleanup of an event generator that
had not started. :class:`EventStreamResponse` watches for ``http.disconnect`` while it streams and always calls
the stream's ``close``, which aborts the engine requests that have not finished.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStream:
    """The SSE events of one route call, and what to do when the response ends however it ends."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        self.events = events
        self._on_close = on_close

    async def close(self) -> None:
        """Closes the event generator (running its ``finally``), then the route's cleanup; idempotent."""
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
        await self._on_close()


class EventStreamResponse(Response):
    """``text/event-stream`` from an :class:`EventStream`; stops streaming as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, watcher):
                task.cancel()
            await asyncio.gather(writer, watcher, return_exceptions=True)
            await self.stream.close()

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for event in self.stream.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write
            return


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
