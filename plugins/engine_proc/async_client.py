"""``AsyncMPClient``: the asyncio face of the multiprocess engine client (used by ``AsyncLLM``).

The ZMQ receive side is the same background thread as the sync client's; it hands outputs to the event loop
through a deque and ``loop.call_soon_threadsafe``. Sends are non-blocking ZMQ sends (no high-water mark), so
the ``*_async`` request methods never wait on the engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from vllite.config import EngineConfig
from vllite.exceptions import EngineClientClosedError, EngineClientUsageError
from vllite.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType

from .client import MPClient


class _LoopWaker:
    """Wakes the coroutine waiting in ``get_output_async`` from the output thread."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None
        self.lock = threading.Lock()

    def bind(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        with self.lock:
            if self.loop is not loop or self.event is None:
                self.event = asyncio.Event()
                self.loop = loop
            return self.event

    def wake(self) -> None:
        with self.lock:
            loop, event = self.loop, self.event
        if loop is None or event is None:
            return
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop is closed; a later bind() picks the outputs up
            pass


class AsyncMPClient(MPClient):
    """Engine client for asyncio frontends: ``await get_output_async()``, ``add_request_async()``, ..."""

    def __init__(self, config: EngineConfig, *, log_stats: bool | None = None, executor_class: type | None = None):
        self._pending: deque[EngineCoreOutputs | BaseException] = deque()
        self._waker = _LoopWaker()
        super().__init__(config, log_stats=log_stats, executor_class=executor_class)

    def _make_output_sink(self) -> Callable[[EngineCoreOutputs | BaseException], None]:
        pending, waker = self._pending, self._waker

        def sink(item: EngineCoreOutputs | BaseException) -> None:
            pending.append(item)
            waker.wake()

        return sink

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next outputs. Raises ``EngineDeadError`` (every time, once dead; it names the engine's cause when
        known) when the engine has died, ``EngineClientClosedError`` once the client is shut down (a waiting call
        wakes with it)."""
        event = self._waker.bind(asyncio.get_running_loop())
        pending = self._pending
        while True:
            if pending:
                item = pending.popleft()
                if isinstance(item, BaseException):
                    pending.appendleft(item)  # sticky: every later call raises too
                    if self.resources.engine_dead:
                        raise self.resources.dead_error() from None
                    raise item
                return item
            if self.resources.engine_dead:
                raise self.resources.dead_error()
            if self.resources.closed:
                raise EngineClientClosedError("The engine client has been shut down.")
            event.clear()
            if pending:
                continue
            await event.wait()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        self._send_input(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Calls an allow-listed engine method; awaits its (possibly deferred) result."""
        return await asyncio.wrap_future(self._send_utility(method, args))

    # add_request, abort_requests and call_utility (blocking) come from MPClient.
    def get_output(self) -> EngineCoreOutputs:
        raise EngineClientUsageError("AsyncMPClient delivers outputs through `await get_output_async()`.")
