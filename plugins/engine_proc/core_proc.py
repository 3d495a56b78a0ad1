"""``EngineCoreProc``: the engine core in its own process, fed and drained over ZMQ by two I/O threads.

Threads and queues::

    input thread  (DEALER per client)  -- decode, preprocess ADD -->  input_queue / aborts_queue
    busy loop     (main thread)        -- step_fn() --------------->  output_queue
    output thread (PUSH per client)    <- encode_into, buffer reuse -- output_queue

The busy loop is the only thread that touches the scheduler. Wire frames are decoded by msgspec into the expected
types only (``EngineCoreRequest``, ``list[str]``, ``UtilityCall``); an oversized or malformed frame is logged and
dropped. Utility calls run only for ``UTILITY_METHODS``. A fatal error sends ``ENGINE_CORE_DEAD`` to every client.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import msgspec
import zmq

from vllite.config import EngineConfig
from vllite.engine.core import EngineCore
from vllite.engine.core_client import UTILITY_METHODS
from vllite.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequestType,
    EngineShutdownState,
    FinishReason,
    UtilityOutput,
    UtilityResult,
)
from vllite.request import Request, RequestStatus
from vllite.sched.output import ModelRunnerOutput, SchedulerOutput

from .io_threads import OUTPUT_STOP, DropLog, EngineIOThreads
from .utils import (
    ENGINE_CORE_DEAD,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeStatus,
    ProcSettings,
    engine_identity,
    make_socket,
)

logger = logging.getLogger(__name__)


class EngineCoreProc(EngineIOThreads, EngineCore):
    """An ``EngineCore`` driven by a busy loop, talking to its client(s) over ZMQ (see the module docstring)."""

    ENGINE_CORE_DEAD = ENGINE_CORE_DEAD

    def __init__(
        self,
        config: EngineConfig,
        handshake_address: str,
        *,
        executor_class: type | None = None,
        log_stats: bool | None = None,
        engine_index: int = 0,
    ) -> None:
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.aborts_queue: queue.Queue[list[str]] = queue.Queue()
        self.settings = ProcSettings.from_config(config)
        self.engine_index = engine_index
        self.engines_running = False
        self.shutdown_state = EngineShutdownState.RUNNING
        self._shutdown_timeout: float | None = None
        self._shutdown_deadline: float | None = None
        self._idle_state_callbacks: list[Callable[[EngineCoreProc], None]] = []
        self.dropped_frames = DropLog()
        identity = engine_identity(engine_index)
        self._zmq_ctx = zmq.Context()
        with self._perform_handshake(handshake_address, identity) as addresses:
            self.addresses = addresses
            self.num_clients = len(addresses.outputs)
            super().__init__(config, executor_class=executor_class, log_stats=log_stats)
            register = getattr(self.model_executor, "register_failure_callback", None)
            if register is not None:
                register(lambda: self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, b"")))
            ready_event = threading.Event()
            self.input_thread = threading.Thread(
                target=self.process_input_sockets,
                args=(addresses.inputs, identity, ready_event),
                name="EngineCoreInput",
                daemon=True,
            )
            self.input_thread.start()
            self.output_thread = threading.Thread(
                target=self.process_output_sockets,
                args=(addresses.outputs, engine_index),
                name="EngineCoreOutput",
                daemon=True,
            )
            self.output_thread.start()
            while not ready_event.wait(timeout=10):
                if not self.input_thread.is_alive():
                    raise RuntimeError("Input socket thread died during startup")

    # ------------------------------------------------------------------ handshake
    @contextmanager
    def _perform_handshake(self, handshake_address: str, identity: bytes) -> Iterator[EngineZmqAddresses]:
        """HELLO → addresses; the body initialises the engine; READY is sent when the body completes."""
        socket = make_socket(self._zmq_ctx, zmq.DEALER, identity=identity, linger=5000, unlimited_hwm=False)
        try:
            socket.connect(handshake_address)
            addresses = self.startup_handshake(socket, self.settings.handshake_timeout_s)
            yield addresses
            socket.send(msgspec.msgpack.encode(HandshakeStatus("READY", local=True, headless=False)))
        finally:
            socket.close()

    @staticmethod
    def startup_handshake(socket: zmq.Socket, timeout_s: float) -> EngineZmqAddresses:
        """Sends HELLO and waits up to ``timeout_s`` for the frontend's ``EngineHandshakeMetadata``."""
        socket.send(msgspec.msgpack.encode(HandshakeStatus("HELLO", local=True, headless=False)))
        if not socket.poll(timeout=int(timeout_s * 1000)):
            raise RuntimeError(f"Did not receive response from front-end process within {timeout_s:g} s.")
        return msgspec.msgpack.decode(socket.recv(), type=EngineHandshakeMetadata).addresses

    # ------------------------------------------------------------------ busy loop
    def has_work(self) -> bool:
        return self.engines_running or self.scheduler.has_requests() or bool(self.batch_queue)

    def is_running(self) -> bool:
        return self.shutdown_state == EngineShutdownState.RUNNING

    def run_busy_loop(self) -> None:
        """Absorbs input, steps, and enqueues outputs until shutdown completes; then raises ``SystemExit``."""
        while self._handle_shutdown():
            self._process_input_queue()
            self._process_engine_step()
        raise SystemExit

    def _process_input_queue(self) -> None:
        while not self.has_work() and self.is_running():
            self._notify_idle_state_callbacks()
            if self.input_queue.empty():
                with self.aborts_queue.mutex:
                    self.aborts_queue.queue.clear()  # idle: every pending abort is also in input_queue
            self._handle_client_request(*self.input_queue.get())
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _notify_idle_state_callbacks(self) -> None:
        while self._idle_state_callbacks:
            self._idle_state_callbacks.pop(0)(self)

    def _process_engine_step(self) -> bool:
        outputs, model_executed = self.step_fn()
        for item in outputs.items() if outputs else ():
            self.output_queue.put_nowait(item)
        if not model_executed and self.scheduler.has_unfinished_requests():
            time.sleep(0.001)  # nothing could run yet: yield the GIL to the I/O threads
        return model_executed

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        model_output = super()._execute(scheduler_output)
        if self.batch_queue is None:  # on the busy-loop thread: apply aborts that arrived during the forward
            self._process_aborts_queue()
        return model_output

    def _process_aborts_queue(self) -> None:
        if self.aborts_queue.empty():
            return
        request_ids: list[str] = []
        while not self.aborts_queue.empty():
            try:
                ids = self.aborts_queue.get_nowait()
            except queue.Empty:
                break
            request_ids.extend((ids,) if isinstance(ids, str) else ids)
        self.abort_requests(request_ids)

    # ------------------------------------------------------------------ shutdown
    def request_shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Moves RUNNING → REQUESTED (from any thread) and wakes the busy loop; ``None`` = configured timeout."""
        if drain_timeout_s is not None:
            self._shutdown_timeout = drain_timeout_s
        if self.shutdown_state == EngineShutdownState.RUNNING:
            self.shutdown_state = EngineShutdownState.REQUESTED
        self.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def _handle_shutdown(self) -> bool:
        if self.shutdown_state == EngineShutdownState.RUNNING:
            return True
        if self.shutdown_state == EngineShutdownState.REQUESTED:
            timeout = self.settings.shutdown_timeout_s if self._shutdown_timeout is None else self._shutdown_timeout
            if timeout <= 0:
                self._abort_all()
            else:
                logger.info(
                    "Draining %d in-flight requests (timeout=%gs)",
                    self.scheduler.get_num_unfinished_requests(),
                    timeout,
                )
                self._shutdown_deadline = time.monotonic() + timeout
            self.shutdown_state = EngineShutdownState.SHUTTING_DOWN
        if self._shutdown_deadline is not None and time.monotonic() > self._shutdown_deadline:
            logger.warning("Drain timeout expired; aborting the remaining requests.")
            self._shutdown_deadline = None
            self._abort_all()
        if not self.has_work():
            logger.info("Shutdown complete")
            return False
        return True

    def _abort_all(self) -> None:
        self._send_abort_outputs(self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED))

    def _reject_add_in_shutdown(self, request: Request) -> bool:
        if self.is_running():
            return False
        self._send_finish_outputs_to_client([request.request_id], request.client_index, FinishReason.ABORT)
        return True

    def _reject_utility_in_shutdown(self, client_index: int, call_id: int, method_name: str) -> bool:
        if self.is_running():
            return False
        logger.warning("Rejected utility call %s: the engine is shutting down.", method_name)
        output = UtilityOutput(call_id, failure_message="Server shutting down")
        self.output_queue.put_nowait((client_index, EngineCoreOutputs(utility_output=output)))
        return True

    # ------------------------------------------------------------------ client requests (busy-loop thread)
    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> None:
        if request_type == EngineCoreRequestType.WAKEUP:
            return
        if request_type == EngineCoreRequestType.ADD:
            if not self._reject_add_in_shutdown(request):
                self._add_request_safely(request)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(request)
        elif request_type == EngineCoreRequestType.UTILITY:
            client_index, call_id, method_name, args = request
            if self._reject_utility_in_shutdown(client_index, call_id, method_name):
                return
            output = UtilityOutput(call_id)

            def enqueue_output(out: UtilityOutput) -> None:
                self.output_queue.put_nowait((client_index, EngineCoreOutputs(utility_output=out)))

            def get_result() -> Any:
                if method_name not in UTILITY_METHODS:
                    raise PermissionError(f"{method_name!r} is not an allowed engine utility")
                method = getattr(self, method_name)
                return method(*self._convert_msgspec_args(method, args))

            self._invoke_utility_method(method_name, get_result, output, enqueue_output)
        elif request_type == EngineCoreRequestType.EXECUTOR_FAILED:
            raise RuntimeError("Executor failed.")
        else:
            logger.error("Unrecognized input request type encountered: %s", request_type)

    def _add_request_safely(self, request: Request) -> None:
        """A bad request (duplicate id, rejected by the scheduler) must not bring the engine down."""
        try:
            self.add_request(request)
        except Exception as exc:
            live = request.request_id in getattr(self.scheduler, "requests", {})
            logger.error("Rejected request %r: %s: %s", request.request_id, type(exc).__name__, exc)
            if not live:
                self._send_finish_outputs_to_client([request.request_id], request.client_index, FinishReason.ERROR)

    @staticmethod
    def _invoke_utility_method(
        name: str, get_result: Callable[[], Any], output: UtilityOutput, enqueue_output: Callable[[UtilityOutput], None]
    ) -> None:
        try:
            result = get_result()
            if isinstance(result, Future):
                # Deferred: answer when the future completes (on whichever thread completes it).
                result.add_done_callback(
                    lambda f: EngineCoreProc._invoke_utility_method(name, f.result, output, enqueue_output)
                )
                return
            output.result = UtilityResult(result)
        except Exception as exc:
            output.failure_message = f"Call to {name} method failed: {exc}"
        enqueue_output(output)

    @staticmethod
    def _convert_msgspec_args(method: Callable[..., Any], args: list[Any] | tuple[Any, ...]) -> tuple[Any, ...]:
        """Converts plain dicts to the ``msgspec.Struct`` types the method's parameters are annotated with."""
        if not args:
            return tuple(args)
        import inspect
        import typing

        params = list(inspect.signature(method).parameters.values())
        if len(args) > len(params):
            raise TypeError(f"{getattr(method, '__name__', method)}() takes {len(params)} arguments, got {len(args)}")
        try:
            hints = typing.get_type_hints(method)
        except Exception:
            hints = {}
        converted = []
        for value, param in zip(args, params):
            annotation = hints.get(param.name)
            if (
                inspect.isclass(annotation)
                and issubclass(annotation, msgspec.Struct)
                and not isinstance(value, annotation)
            ):
                value = msgspec.convert(value, type=annotation)
            converted.append(value)
        return tuple(converted)

    # ------------------------------------------------------------------ pause / sleep (process versions)
    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Future | None:  # type: ignore[override]
        """``abort``: abort everything in flight (clients get ABORT outputs); ``wait``: stop admitting and let
        running requests finish; ``keep``: freeze everything in place. Returns ``None`` when the engine is already
        idle, else a ``Future`` completed when it becomes idle (a UTILITY call answers only then)."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode!r} (expected 'abort', 'wait' or 'keep').")
        if mode == "abort":
            self._abort_all()
        pause_state = self._pause_state_cls.PAUSED_ALL if mode == "keep" else self._pause_state_cls.PAUSED_NEW
        self.scheduler.set_pause_state(pause_state)
        if not self.has_work():
            if clear_cache:
                self._reset_caches()
            return None
        future: Future = Future()

        def on_idle(engine: EngineCoreProc) -> None:
            if clear_cache:
                engine._reset_caches()
            future.set_result(None)

        self._idle_state_callbacks.append(on_idle)
        return future

    def _reset_caches(self) -> None:
        try:
            self.reset_prefix_cache(False)
        except Exception:
            logger.exception("Resetting the prefix cache failed")

    def sleep(self, level: int = 1, mode: str = "abort") -> Future | None:  # type: ignore[override]
        """Pauses (``mode``), then frees memory: level 0 pauses only, 1 offloads weights, 2 discards them."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}.")
        pause_future = self.pause_scheduler(mode, clear_cache=level >= 1)
        if level < 1:
            return pause_future
        executor = self.model_executor
        if pause_future is None:
            executor.sleep(level)
            return None
        future: Future = Future()

        def after_pause(f: Future) -> None:
            try:
                f.result()
                future.set_result(executor.sleep(level))
            except Exception as exc:
                future.set_exception(exc)

        pause_future.add_done_callback(after_pause)
        return future

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores what ``sleep`` freed (``tags`` select parts; ``"scheduling"`` alone only resumes), then resumes."""
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            self.model_executor.wake_up(tags)
        self.resume_scheduler()

    # ------------------------------------------------------------------ output helpers
    def _send_finish_outputs_to_client(self, req_ids: list[str], client_index: int, reason: FinishReason) -> None:
        outputs = [EngineCoreOutput(req_id, [], finish_reason=reason) for req_id in req_ids]
        self.output_queue.put_nowait((client_index, EngineCoreOutputs(outputs=outputs, finished_requests=set(req_ids))))

    def _send_abort_outputs(self, aborted: list[Request] | None) -> None:
        by_client: dict[int, list[str]] = defaultdict(list)
        for request in aborted or ():
            by_client[request.client_index].append(request.request_id)
        for client_index, req_ids in by_client.items():
            self._send_finish_outputs_to_client(req_ids, client_index, FinishReason.ABORT)

    def _send_engine_dead(self) -> None:
        self.output_queue.put_nowait(ENGINE_CORE_DEAD)
        self.output_thread.join(timeout=5.0)
        if self.output_thread.is_alive():
            logger.critical("The engine-dead notice could not be sent; the ZMQ connection may be broken.")

    def stop_output_thread(self, timeout: float = 5.0) -> None:
        """Lets the output thread flush what is queued, close its sockets and exit (clean shutdown)."""
        thread = getattr(self, "output_thread", None)
        if thread is not None and thread.is_alive():
            self.output_queue.put_nowait(OUTPUT_STOP)
            thread.join(timeout=timeout)
