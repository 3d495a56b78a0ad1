"""``EngineCoreProc``: an ``EngineCore`` in its own process, fed and drained over ZMQ by two I/O threads.

Threads and queues::

    input thread  (DEALER per client)  -- decode, preprocess ADD -->  input_queue
    busy loop     (main thread)        -- engine.step_fn() ------->  output_queue
    output thread (PUSH per client)    <- encode_into, buffer reuse -- output_queue

The process wrapper holds the engine; it does not change what the engine does. Pause, sleep and every other
utility mean exactly what they mean in-process (``EngineCore``); the wrapper only adds the I/O loop, deferred
utility answers (a utility that returns a ``Future`` is answered when it completes) and the shutdown states.
The busy loop is the only thread that touches the engine. Utility calls run only for ``UTILITY_METHODS``. A
fatal error sends ``ENGINE_CORE_DEAD`` and its cause (``EngineErrorCause``) to every client.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import msgspec
import zmq

from vllite.config import EngineConfig
from vllite.engine.core import EngineCore
from vllite.engine.core_client import UTILITY_METHODS
from vllite.exceptions import EngineStartupError, ExecutorFailedError, UtilityCallError
from vllite.platform.cpu_threads import CpuThreadPlan, resolve_plan
from vllite.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineShutdownState,
    FinishReason,
    UtilityOutput,
    UtilityResult,
)
from vllite.request import Request

from .io_threads import EngineIOThreads
from .utils import (
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeStatus,
    ProcSettings,
    engine_identity,
    make_socket,
)

logger = logging.getLogger(__name__)


class EngineCoreProc:
    """An ``EngineCore`` driven by a busy loop, talking to its client(s) over ZMQ (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        handshake_address: str,
        *,
        executor_class: type | None = None,
        log_stats: bool | None = None,
        engine_index: int = 0,
        curve_server_key: bytes | None = None,
        cpu_plan: CpuThreadPlan | None = None,
    ) -> None:
        self.settings = ProcSettings.from_config(config)
        self.settings.curve_server_key = curve_server_key
        self.engine_index = engine_index
        self.shutdown_state = EngineShutdownState.RUNNING
        self.engines_running = False  # data parallel: a wave in which this engine must keep stepping
        self._shutdown_timeout: float | None = None
        self._shutdown_deadline: float | None = None
        identity = engine_identity(engine_index)
        self._zmq_ctx = zmq.Context()
        with self._perform_handshake(handshake_address, identity) as addresses:
            self.engine = EngineCore(config, executor_class=executor_class, log_stats=log_stats)
            self.io = EngineIOThreads(self.settings, len(addresses.outputs), self._preprocess_add_request)
            register = getattr(self.engine.model_executor, "register_failure_callback", None)
            if register is not None:
                register(lambda: self.io.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, b"")))
            self.io.start(addresses.inputs, addresses.outputs, identity, self.engine.info, engine_index)
            # The busy loop steps the model on this thread: the executor places its model's threads here and the
            # I/O threads on the CPUs left to them (Executor.govern_process_steps, vllite.platform.cpu_threads).
            govern = getattr(self.engine.model_executor, "govern_process_steps", None)
            if govern is not None:
                govern(self.engine, cpu_plan or resolve_plan())

    def _preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """Input thread: the engine's preprocessing of an ADD (a subclass may carry more of the request along)."""
        return self.engine.preprocess_add_request(request)

    # ------------------------------------------------------------------ handshake
    @contextmanager
    def _perform_handshake(self, handshake_address: str, identity: bytes) -> Iterator[EngineZmqAddresses]:
        """HELLO → addresses; the body initialises the engine; READY is sent when the body completes."""
        socket = make_socket(
            self._zmq_ctx,
            zmq.DEALER,
            identity=identity,
            linger=5000,
            unlimited_hwm=False,
            curve_server_key=self.settings.curve_server_key,
        )
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
            raise EngineStartupError(f"Did not receive response from front-end process within {timeout_s:g} s.")
        return msgspec.msgpack.decode(socket.recv(), type=EngineHandshakeMetadata).addresses

    # ------------------------------------------------------------------ busy loop
    def is_running(self) -> bool:
        return self.shutdown_state == EngineShutdownState.RUNNING

    def has_work(self) -> bool:
        return self.engines_running or self.engine.has_work()

    def run_busy_loop(self) -> None:
        """Absorbs input, steps, and enqueues outputs until shutdown completes; then raises ``SystemExit``."""
        while self._handle_shutdown():
            self._process_input_queue()
            self._process_engine_step()
        raise SystemExit

    def _process_input_queue(self) -> None:
        input_queue = self.io.input_queue
        while not self.has_work() and self.is_running():
            self._handle_client_request(*input_queue.get())
        while not input_queue.empty():
            self._handle_client_request(*input_queue.get_nowait())

    def _process_engine_step(self) -> None:
        outputs, model_executed = self.engine.step_fn()
        if outputs:
            self.io.send_outputs(outputs)
        if not model_executed and self.engine.scheduler.has_unfinished_requests():
            time.sleep(0.001)  # nothing could run yet: yield the GIL to the I/O threads

    # ------------------------------------------------------------------ shutdown
    def request_shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Moves RUNNING → REQUESTED (from any thread) and wakes the busy loop; ``None`` = configured timeout."""
        if drain_timeout_s is not None:
            self._shutdown_timeout = drain_timeout_s
        if self.shutdown_state == EngineShutdownState.RUNNING:
            self.shutdown_state = EngineShutdownState.REQUESTED
        self.io.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def _handle_shutdown(self) -> bool:
        if self.shutdown_state == EngineShutdownState.RUNNING:
            return True
        if self.shutdown_state == EngineShutdownState.REQUESTED:
            timeout = self.settings.shutdown_timeout_s if self._shutdown_timeout is None else self._shutdown_timeout
            if timeout <= 0:
                self.io.send_outputs(self.engine.abort_all_requests())
            else:
                logger.info(
                    "Draining %d in-flight requests (timeout=%gs)", self.engine.get_num_unfinished_requests(), timeout
                )
                self._shutdown_deadline = time.monotonic() + timeout
            self.shutdown_state = EngineShutdownState.SHUTTING_DOWN
        if self._shutdown_deadline is not None and time.monotonic() > self._shutdown_deadline:
            logger.warning("Drain timeout expired; aborting the remaining requests.")
            self._shutdown_deadline = None
            self.io.send_outputs(self.engine.abort_all_requests())
        if not (self.engines_running or self.engine.has_client_work()):
            logger.info("Shutdown complete")
            return False
        return True

    # ------------------------------------------------------------------ client requests (busy-loop thread)
    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> None:
        if request_type == EngineCoreRequestType.WAKEUP:
            return
        if request_type == EngineCoreRequestType.ADD:
            self._add_request(request)
        elif request_type == EngineCoreRequestType.ABORT:
            self.engine.abort_requests(request)
        elif request_type == EngineCoreRequestType.UTILITY:
            self._call_utility(*request)
        elif request_type == EngineCoreRequestType.EXECUTOR_FAILED:
            raise ExecutorFailedError("The executor failed.")
        else:
            logger.error("Unrecognized input request type encountered: %s", request_type)

    def _add_request(self, request: Request) -> None:
        """A request arriving during shutdown is aborted; a bad one (duplicate id, rejected by the scheduler)
        finishes with ERROR. Neither brings the engine down."""
        if not self.is_running():
            self.io.send_finish_outputs([request.request_id], request.client_index, FinishReason.ABORT)
            return
        try:
            self.engine.add_request(request)
        except Exception as exc:
            live = request.request_id in getattr(self.engine.scheduler, "requests", {})
            cause = f"the engine rejected the request: {type(exc).__name__}: {exc}"
            logger.error("Rejected request %r: %s", request.request_id, cause)
            if not live:
                self.io.send_finish_outputs([request.request_id], request.client_index, FinishReason.ERROR, cause)

    def _call_utility(self, client_index: int, call_id: int, method_name: str, args: list[Any]) -> None:
        output = UtilityOutput(call_id)

        def enqueue_output(out: UtilityOutput) -> None:
            self.io.output_queue.put_nowait((client_index, EngineCoreOutputs(utility_output=out)))

        if not self.is_running():
            logger.warning("Rejected utility call %s: the engine is shutting down.", method_name)
            output.failure_message = "Server shutting down"
            enqueue_output(output)
            return

        def get_result() -> Any:
            if method_name not in UTILITY_METHODS:
                raise PermissionError(f"{method_name!r} is not an allowed engine utility")
            method = getattr(self.engine, method_name)
            check_utility_arguments(method_name, method, args)
            if method_name == "collective_rpc":  # worker results are arbitrary objects: send what the wire can carry
                return [wire_safe(result) for result in method(*args)]
            return method(*args)

        _invoke_utility_method(method_name, get_result, output, enqueue_output)

    # ------------------------------------------------------------------ process exit
    def send_engine_dead(self, cause: BaseException | None = None) -> None:
        """Tells every client the engine died of ``cause`` (type and message cross the process boundary)."""
        self.io.send_engine_dead(cause)

    def stop_output_thread(self, timeout: float = 5.0) -> None:
        self.io.stop_output_thread(timeout)

    def shutdown(self) -> None:
        self.engine.shutdown()


def check_utility_arguments(name: str, method: Callable[..., Any], args: list[Any]) -> None:
    """Refuses arguments that do not fit the method's signature before it runs (``UtilityCallError``)."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return  # no introspectable signature: the call itself reports a mismatch
    try:
        signature.bind(*args)
    except TypeError as exc:
        raise UtilityCallError(f"invalid arguments for {name}{signature}: {exc}") from None


def wire_safe(value: Any) -> Any:
    """``value`` as something the engine's msgpack encoder carries: builtins, tensors, arrays and msgspec Structs
    as they are (containers converted item by item), anything else as its ``str()`` (vLLM's answer for a worker
    result JSON cannot hold)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, msgspec.Struct)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [wire_safe(item) for item in value]
    if isinstance(value, dict):
        return {str(key): wire_safe(item) for key, item in value.items()}
    if type(value).__module__.split(".")[0] in ("torch", "numpy") and hasattr(value, "shape"):
        return value  # tensors and arrays travel as raw buffers
    return str(value)


def _invoke_utility_method(
    name: str, get_result: Callable[[], Any], output: UtilityOutput, enqueue_output: Callable[[UtilityOutput], None]
) -> None:
    """Answers one utility call: at once, or when the ``Future`` it returned completes (on whichever thread)."""
    try:
        result = get_result()
        if isinstance(result, Future):
            result.add_done_callback(lambda f: _invoke_utility_method(name, f.result, output, enqueue_output))
            return
        output.result = UtilityResult(result)
    except Exception as exc:
        output.failure_message = f"Call to {name} method failed: {exc}"
    enqueue_output(output)
