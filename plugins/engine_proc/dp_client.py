"""Data-parallel engine clients: N engine cores behind one client (``--data-parallel-size N``).

``DPClient`` composes per-engine clients (``dp_engines.DPEngineClient``: each an ``MPClient`` with its own process,
sockets, handshake, output thread and death watch) with a ``DPRouter``:

* ``add_request`` sends each request to the engine the router picks (least loaded, the named rank, or the engine
  of its job / prompt prefix); ``abort_requests`` sends each id to the engine that owns it;
* every engine's output thread feeds one merged stream (``get_output()`` / ``get_output_async()``), and the router
  reads the load each engine publishes with its outputs;
* utility calls (``reset_prefix_cache``, pause/resume, sleep/wake, counts, KV usage) go to every live engine at
  once and their answers are combined (``combine_results``); shutdown stops every engine and removes every socket;
* an engine that dies is marked dead: its requests in flight end with ``EngineDeadError`` (a ``RequestsFailed``
  notice in the stream: ``get_output()`` turns it into finished ``error`` outputs naming the cause, ``AsyncLLM``
  raises it in each of those streams), or with ``--dp-retry`` continue on a live engine (``dp_retry``); new work
  goes to the others, and once none is left every call raises ``EngineDeadError``.

How engines are started is the backend's part (``_start_engines``): local processes here, Ray actors in
``vllite.plugins.ray_dp``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import weakref
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import msgspec

from vllite.config import EngineConfig
from vllite.engine.core_client import EngineCoreClient
from vllite.exceptions import EngineClientClosedError, EngineClientUsageError, EngineDeadError
from vllite.plugins.engine_proc.serial import MsgpackEncoder
from vllite.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
)

from .async_client import _LoopWaker
from .client import MPClient
from .dp_engines import Sink, start_local_engines, stop_engines
from .dp_group import GROUP_ADDRESS_KEY, free_group_address
from .dp_retry import RetryLedger
from .dp_router import DPRouter
from .dp_stream import DPResources, RequestsFailed, StreamItem, make_merged_sink
from .dp_waves import WaveCoordinator
from .utils import PLUGIN_KEY

logger = logging.getLogger(__name__)


def with_group_address(config: EngineConfig, address: str) -> EngineConfig:
    """The config with the lockstep engines' all-reduce address (``dp_group``) in the engine-process settings."""
    plugin_config = dict(config.plugin_config)
    plugin_config[PLUGIN_KEY] = {**(plugin_config.get(PLUGIN_KEY) or {}), GROUP_ADDRESS_KEY: address}
    return dataclasses.replace(config, plugin_config=plugin_config)


def combine_results(method: str, results: Sequence[Any]) -> Any:
    """One answer from every engine's answer to a utility call."""
    if method in ("reset_prefix_cache", "is_scheduler_paused", "is_sleeping"):
        return all(results)
    if method in ("add_lora", "remove_lora", "pin_lora"):
        return any(results)
    if method == "list_loras":
        return set().union(*results)
    if method == "get_request_counts":
        return [sum(column) for column in zip(*results)]
    if method == "get_num_unfinished_requests":
        return sum(results)
    if method == "get_kv_cache_usage":
        return sum(results) / len(results)
    if method == "get_engine_info":
        return results[0]
    if method in ("pause_scheduler", "resume_scheduler", "sleep", "wake_up"):
        return None
    return list(results)


class DPClient(EngineCoreClient):
    """N engine cores behind one client (see the module docstring); base of the sync and async faces."""

    def __init__(self, config: EngineConfig, *, log_stats: bool | None = None, executor_class: type | None = None):
        parallel = config.parallel_config
        self.config = config
        self.num_engines = parallel.data_parallel_size
        self.resources = DPResources(self.num_engines)
        self.router = DPRouter(self.num_engines, routing=parallel.dp_routing, block_size=config.cache_config.block_size)
        self.waves = WaveCoordinator() if parallel.dp_lockstep else None
        self.retry_ledger = RetryLedger() if parallel.dp_retry else None
        if self.waves is not None:
            config = with_group_address(config, free_group_address())
        deliver = self._make_deliver()
        broadcast = weakref.WeakMethod(self._broadcast_wave)
        resubmit = weakref.WeakMethod(self._resubmit) if self.retry_ledger is not None else None
        ledger = self.retry_ledger
        sinks = [
            make_merged_sink(i, self.router, self.resources, deliver, self.waves, broadcast, ledger, resubmit)
            for i in range(self.num_engines)
        ]
        try:
            self.engines: list[MPClient] = self._start_engines(config, sinks, log_stats, executor_class)
        except BaseException:
            self.resources.closed = True
            raise
        self.engine_info = self.engines[0].engine_info

    def _start_engines(
        self, config: EngineConfig, sinks: Sequence[Sink], log_stats: bool | None, executor_class: type | None
    ) -> list[MPClient]:
        """Starts one engine per sink and returns their clients (local processes; other backends override)."""
        return list(start_local_engines(config, sinks, log_stats=log_stats, executor_class=executor_class))

    @abstractmethod
    def _make_deliver(self) -> Callable[[StreamItem], None]:
        """How an engine's output thread hands an item to the merged stream (must not refer to the client)."""

    # ------------------------------------------------------------------ requests
    def ensure_alive(self) -> None:
        """Raises ``EngineClientClosedError`` after shutdown, ``EngineDeadError`` once every engine is dead."""
        if self.resources.closed:
            raise EngineClientClosedError("The engine client has been shut down.")
        if self.resources.engine_dead:
            raise self.resources.dead_error()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Sends the request to the engine the router picks. Should that engine die meanwhile, the request fails
        with the engine's other requests (a ``RequestsFailed`` notice)."""
        self.ensure_alive()
        engine = self.router.route(request)
        starts_wave = self.waves is not None and self.waves.stamp(request)
        if self.retry_ledger is not None and not (request.resumable or request.continuation):
            self.retry_ledger.add(request)  # a session's context lives in its engine: it fails with it
        try:
            self.engines[engine]._send_input(EngineCoreRequestType.ADD, request)
        except EngineDeadError:
            pass  # the engine's output thread handles its death: this request fails (or continues) with its others
        except BaseException:
            self.router.forget(request.request_id)
            if self.retry_ledger is not None:
                self.retry_ledger.forget([request.request_id])
            raise
        if starts_wave:
            self._broadcast_wave(request.current_wave, engine)

    def _broadcast_wave(self, wave: int, exclude_engine: int) -> None:
        """Lockstep: ``START_DP_WAVE`` to every live engine but ``exclude_engine`` (which starts on its own).
        Called from the frontend and from the engines' output threads, so it encodes with no shared encoder."""
        payload = msgspec.msgpack.encode((wave, exclude_engine))
        for engine in self.router.live_engines():
            if engine != exclude_engine:
                try:
                    self.engines[engine]._send_frames(EngineCoreRequestType.START_DP_WAVE, [payload])
                except (EngineDeadError, EngineClientClosedError):
                    continue

    def _resubmit(self, request_ids: list[str]) -> list[str]:
        """``--dp-retry``: sends each request of a dead engine on to a live one, continuing from its tokens so far;
        returns the ids that could not continue. Runs on the dead engine's output thread, so it has its own
        encoder."""
        assert self.retry_ledger is not None
        encoder, failed = MsgpackEncoder(), []
        for request_id in request_ids:
            request = self.retry_ledger.continuation(request_id)
            if request is None or self.resources.closed:
                failed.append(request_id)
                continue
            try:
                engine = self.router.route(request)
            except EngineDeadError:
                failed.append(request_id)
                continue
            try:
                self.engines[engine]._send_frames(EngineCoreRequestType.ADD, encoder.encode(request))
                if request_id not in self.retry_ledger:  # aborted meanwhile: its abort found no owner
                    self.engines[engine]._send_frames(EngineCoreRequestType.ABORT, encoder.encode([request_id]))
            except (EngineDeadError, EngineClientClosedError):
                self.router.forget(request_id)
                failed.append(request_id)
        self.retry_ledger.forget(failed)
        return failed

    def abort_requests(self, request_ids: list[str]) -> None:
        """Aborts each request on the engine that owns it; unknown or finished ids are ignored."""
        if not request_ids or self.resources.closed:
            return
        if self.retry_ledger is not None:
            self.retry_ledger.forget(request_ids)
        for engine, ids in self.router.group_by_owner(request_ids).items():
            try:
                self.engines[engine].abort_requests(ids)
            except EngineDeadError:
                pass  # its requests have failed with it

    # ------------------------------------------------------------------ utilities (fan out)
    def _send_utility_all(self, method: str, args: tuple[Any, ...]) -> list[Future]:
        self.ensure_alive()
        futures = []
        for engine in self.router.live_engines():
            try:
                futures.append(self.engines[engine]._send_utility(method, args))
            except EngineDeadError:
                continue
        if not futures:
            raise self.resources.dead_error()
        return futures

    def call_utility(self, method: str, *args: Any) -> Any:
        """Calls an engine-core method on every live engine and combines the answers (``combine_results``)."""
        futures = self._send_utility_all(method, args)
        return _combine(method, [_outcome(future) for future in futures], self.resources)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stops every engine (in parallel) and removes their sockets; waiting callers wake with
        ``EngineClientClosedError``. Idempotent."""
        if self.resources.closed:
            return
        self.resources.closed = True
        self._make_deliver()(EngineClientClosedError("The engine client was shut down while this call was waiting."))
        stop_engines(getattr(self, "engines", []))

    @property
    def is_engine_dead(self) -> bool:
        """True once every engine is dead."""
        return self.resources.engine_dead

    @property
    def dead_engines(self) -> set[int]:
        """Indices of the engines that died."""
        return set(self.resources.dead_engines)


def _outcome(future: Future) -> tuple[bool, Any]:
    try:
        return True, future.result()
    except EngineDeadError as exc:
        return False, exc


def _combine(method: str, outcomes: list[tuple[bool, Any]], resources: DPResources) -> Any:
    results = [value for ok, value in outcomes if ok]
    if not results:
        raise resources.dead_error()
    return combine_results(method, results)


class SyncDPClient(DPClient):
    """The data-parallel client of ``LLM`` / ``LLMEngine``: ``get_output()`` blocks on the merged stream."""

    def __init__(self, config: EngineConfig, *, log_stats: bool | None = None, executor_class: type | None = None):
        self.outputs_queue: queue.Queue[StreamItem] = queue.Queue()
        super().__init__(config, log_stats=log_stats, executor_class=executor_class)

    def _make_deliver(self) -> Callable[[StreamItem], None]:
        return self.outputs_queue.put_nowait

    def get_output(self) -> EngineCoreOutputs:
        """The next outputs of any engine; a dead engine's requests come back finished with ``error``. Raises
        ``EngineDeadError`` once every engine is dead, ``EngineClientClosedError`` after shutdown (sticky)."""
        item = self.outputs_queue.get()
        if isinstance(item, RequestsFailed):
            return item.as_outputs()
        if isinstance(item, BaseException):
            self.outputs_queue.put_nowait(item)
            raise item
        return item


class AsyncDPClient(DPClient):
    """The data-parallel client of ``AsyncLLM``: ``await get_output_async()`` on the merged stream."""

    def __init__(self, config: EngineConfig, *, log_stats: bool | None = None, executor_class: type | None = None):
        self._pending: deque[StreamItem] = deque()
        self._waker = _LoopWaker()
        super().__init__(config, log_stats=log_stats, executor_class=executor_class)

    def _make_deliver(self) -> Callable[[StreamItem], None]:
        pending, waker = self._pending, self._waker

        def deliver(item: StreamItem) -> None:
            pending.append(item)
            waker.wake()

        return deliver

    async def get_output_async(self) -> EngineCoreOutputs | RequestsFailed:
        """The next item of the merged stream: outputs, or a ``RequestsFailed`` notice (``AsyncLLM`` fails those
        streams with its error). Raises ``EngineDeadError`` once every engine is dead, ``EngineClientClosedError``
        after shutdown."""
        event = self._waker.bind(asyncio.get_running_loop())
        pending = self._pending
        while True:
            if pending:
                item = pending.popleft()
                if isinstance(item, BaseException):
                    pending.appendleft(item)
                    raise item
                return item
            if self.resources.closed:
                raise EngineClientClosedError("The engine client has been shut down.")
            event.clear()
            if pending:
                continue
            await event.wait()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """``add_request`` (ZMQ sends never block)."""
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """``abort_requests``."""
        self.abort_requests(request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Calls an engine-core method on every live engine at once and combines the answers."""
        futures = self._send_utility_all(method, args)
        outcomes = []
        for future in futures:
            try:
                outcomes.append((True, await asyncio.wrap_future(future)))
            except EngineDeadError as exc:
                outcomes.append((False, exc))
        return _combine(method, outcomes, self.resources)

    def get_output(self) -> EngineCoreOutputs:
        """Not available: outputs come through ``await get_output_async()``."""
        raise EngineClientUsageError("AsyncDPClient delivers outputs through `await get_output_async()`.")
