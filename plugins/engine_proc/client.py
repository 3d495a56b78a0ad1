"""The multiprocess engine clients' shared part: launch, handshake, output thread, utility futures, death, cleanup.

``MPClient`` spawns ``EngineCoreProc`` (multiprocessing "spawn"; the config is the process argument), binds a
ROUTER (requests), a PULL (outputs) and a handshake ROUTER, and performs HELLO → addresses → READY within
``VLLITE_ENGINE_READY_TIMEOUT_S``. A background thread receives outputs, answers utility futures, and watches the
child's process sentinel: when the engine dies (a crash, SIGKILL, OOM) or sends ``ENGINE_CORE_DEAD``, every
waiting call raises ``EngineDeadError``. Nothing in the thread closures refers to the client, so it can be
garbage-collected; ``weakref.finalize`` then (or ``shutdown()``, or interpreter exit) stops the child and removes
the sockets and their private directory.
"""

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
import weakref
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from vllite.config import EngineConfig
from vllite.engine.core_client import UTILITY_METHODS, EngineCoreClient, sigint_deferred
from vllite.exceptions import EngineClientClosedError, EngineClientUsageError, EngineDeadError, EngineStartupError
from vllite.platform.cpu_threads import confine_frontend, resolve_plan
from vllite.plugins.engine_proc.serial import MsgpackEncoder
from vllite.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, EngineInfo

from .client_io import _fail_pending, process_outputs_socket
from .client_resources import BackgroundResources
from .shared_engine import add_client_addresses, api_server_count, attach_info, bind_attached, wait_attached
from .spawning import main_module_hidden_from_spawn, sigint_blocked
from .utils import (
    EndpointFactory,
    EngineErrorCause,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeFailure,
    HandshakeStatus,
    ProcSettings,
    curve_server_keys,
    engine_identity,
    exit_signal_name,
    make_socket,
    peek_exit_code,
)

logger = logging.getLogger(__name__)

_RECONNECT_GRACE_S = 2.0
_SIGNAL_CHECK_INTERVAL_S = 0.2  # the longest a Ctrl-C may wait while get_output() blocks
_PASSED_ENV_PREFIXES = ("VLLITE_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "CUDA_", "TRITON_", "OMP_")


class MPClient(EngineCoreClient):
    """Runs the engine core in a child process and talks to it over ZMQ (base of the sync and async clients)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        log_stats: bool | None = None,
        executor_class: type | None = None,
        engine_index: int = 0,
        env_overrides: dict[str, str] | None = None,
        deferred: bool = False,
    ):
        """Starts the engine process and waits until it is ready; with ``deferred``, call ``start_engine()`` and
        ``wait_until_ready()`` (how the data-parallel client starts several engines at once). ``engine_index``
        is the engine's rank (its identity and ``EngineCoreOutputs.engine_index``); ``env_overrides`` are set in
        the engine process before anything loads (a data-parallel engine's own CPUs)."""
        self.config = config
        self.settings = ProcSettings.from_config(config)
        self.resources = resources = BackgroundResources(
            shutdown_timeout_s=self.settings.shutdown_timeout_s, heartbeat_timeout_s=self.settings.heartbeat_timeout_s
        )
        self._finalizer = weakref.finalize(self, resources)
        self.encoder = MsgpackEncoder()
        self.utility_results: dict[int, Future] = {}
        self._call_ids = itertools.count(1)
        self.engine_index = engine_index
        self.core_engine = engine_identity(engine_index)
        self._launch_args = (log_stats, executor_class, dict(env_overrides or {}))
        self._handshake: zmq.Socket | None = None
        self._addresses: EngineZmqAddresses | None = None
        # Several API servers on one engine (shared_engine.py): this one's index, and the engine's pidfd when it
        # joins an engine another frontend started.
        self._attach = attach_info(config)
        self.client_index = self._attach.client_index if self._attach is not None else 0
        self.engine_sentinel: int | None = None
        if not deferred:
            try:
                self.start_engine()
                self.wait_until_ready()
            except BaseException:
                self._finalizer()
                raise

    # ------------------------------------------------------------------ launch
    def start_engine(self) -> None:
        """Binds the sockets and starts the engine process (returns at once; ``wait_until_ready()`` follows); an
        attached client (``shared_engine.py``) binds its sockets only."""
        if self._attach is not None:
            bind_attached(self, self._attach)
            return
        config = self.config
        log_stats, executor_class, env_overrides = self._launch_args
        res = self.resources
        res.ctx = zmq.Context(io_threads=2)
        res.endpoints = endpoints = EndpointFactory(self.settings.tcp_host)
        # TCP: every socket here is a CURVE server with a key pair made for this engine; the child learns the public
        # key from its process arguments only, so a peer without it can neither connect, inject nor read.
        keys = curve_server_keys(self.settings.tcp_host)
        secret = keys[1] if keys is not None else None
        handshake = make_socket(res.ctx, zmq.ROUTER, linger=0, unlimited_hwm=False, curve_secret_key=secret)
        res.input_socket = make_socket(res.ctx, zmq.ROUTER, linger=0, curve_secret_key=secret)
        res.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        res.input_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # an engine that reconnects takes its identity back
        res.output_socket = make_socket(
            res.ctx, zmq.PULL, linger=0, max_msg_size=self.settings.max_frame_bytes, curve_secret_key=secret
        )
        self._handshake = handshake
        handshake_address = endpoints.bind(handshake, "handshake")
        self._addresses = EngineZmqAddresses(
            inputs=[endpoints.bind(res.input_socket, "input")],
            outputs=[endpoints.bind(res.output_socket, "output")],
        )
        add_client_addresses(self._addresses, endpoints, api_server_count(config))
        mp = multiprocessing.get_context("spawn")
        child_conn, res.parent_conn = mp.Pipe(duplex=False)
        env = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV_PREFIXES)}
        entry_args = (config, handshake_address, child_conn, list(sys.path), env, _log_level())
        entry_kwargs = {
            "engine_index": self.engine_index,
            "executor_class": executor_class,
            "log_stats": log_stats,
            "curve_server_key": keys[0] if keys is not None else None,
            "env_overrides": env_overrides,
        }
        res.proc = mp.Process(
            target=_engine_entry, name="VLLiteEngineCore", args=entry_args, kwargs=entry_kwargs, daemon=True
        )
        # The engine process must not re-run the user's script (no __main__ guard needed), and it leaves a Ctrl-C
        # to this process, see spawning.py.
        with main_module_hidden_from_spawn((config, executor_class)), sigint_blocked():
            res.proc.start()
        child_conn.close()

    def wait_until_ready(self) -> None:
        """Completes the handshake of a started engine and starts the output thread; raises
        ``EngineStartupError`` (or ``TimeoutError``) if the engine fails to come up."""
        if self._attach is not None:
            self.engine_info = wait_attached(self)
            confine_frontend(resolve_plan())
            self._start_output_thread()
            return
        handshake, addresses = self._handshake, self._addresses
        assert handshake is not None and addresses is not None, "start_engine() first"
        try:
            self.engine_info = self._wait_for_engine_startup(handshake, addresses)
            if self.config.parallel_config.data_parallel_size == 1:
                confine_frontend(resolve_plan())  # off the engine's pinned CPUs
        finally:
            handshake.close(linger=0)
            self._handshake = None
        self._start_output_thread()

    def _wait_for_engine_startup(self, handshake: zmq.Socket, addresses: EngineZmqAddresses) -> EngineInfo:
        """HELLO → send addresses; then wait for the engine's ``EngineInfo`` (input socket) and READY (handshake
        socket)."""
        res = self.resources
        proc = res.proc
        input_socket = res.input_socket
        assert input_socket is not None  # bound before the engine process is started
        timeout_s = self.settings.ready_timeout_s
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(handshake, zmq.POLLIN)
        poller.register(input_socket, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        ready: EngineInfo | None = None
        got_ready_status = False
        failure: EngineErrorCause | None = None
        while ready is None or not got_ready_status:
            remaining = deadline - time.monotonic()
            events = dict(poller.poll(timeout=max(0, int(remaining * 1000)))) if remaining > 0 else {}
            if not events:
                raise TimeoutError(
                    f"Timed out waiting for the engine core process to start. Waited {timeout_s:g}s "
                    "(configured by VLLITE_ENGINE_READY_TIMEOUT_S). Slow model loading is the usual cause; "
                    "to wait longer set VLLITE_ENGINE_READY_TIMEOUT_S=<seconds>."
                )
            if handshake in events:
                identity, payload = handshake.recv_multipart()
                status = msgspec.msgpack.decode(payload, type=HandshakeStatus)
                if status.status == "HELLO":
                    metadata = EngineHandshakeMetadata(addresses=addresses)
                    handshake.send_multipart([identity, msgspec.msgpack.encode(metadata)])
                elif status.status == "READY":
                    got_ready_status = True
                elif status.status == "FAILED":
                    failure = _decode_failure(payload)
            if input_socket in events:
                identity, payload = input_socket.recv_multipart()
                if identity != self.core_engine:
                    raise EngineStartupError(f"Unexpected engine identity {identity!r} during start-up.")
                ready = msgspec.msgpack.decode(payload, type=EngineInfo)
            if proc.sentinel in events or peek_exit_code(proc) is not None:
                raise _startup_failure(proc, handshake, failure)
        return ready

    def _start_output_thread(self) -> None:
        res = self.resources
        res.shutdown_path = f"inproc://vllite-output-shutdown-{id(self):x}-{os.getpid()}"
        sink = self._make_output_sink()
        sentinel = res.proc.sentinel if res.proc is not None else self.engine_sentinel
        started = threading.Event()
        res.output_thread = threading.Thread(
            target=process_outputs_socket,
            args=(res, res.output_socket, res.shutdown_path, sentinel, self.utility_results, sink, started),
            name="EngineCoreOutputQueueThread",
            daemon=True,
        )
        res.output_thread.start()
        started.wait(timeout=10)

    @abstractmethod
    def _make_output_sink(self) -> Callable[[EngineCoreOutputs | BaseException], None]:
        """What the output thread calls with each batch of outputs, or with the terminal exception."""

    # ------------------------------------------------------------------ sending
    def ensure_alive(self) -> None:
        if self.resources.engine_dead:
            raise self.resources.dead_error()
        if self.resources.closed:
            raise EngineClientClosedError("The engine client has been shut down.")

    def _send_input(self, request_type: EngineCoreRequestType, request: Any) -> None:
        self.ensure_alive()
        self._send_frames(request_type, self.encoder.encode(request))

    def _send_frames(self, request_type: EngineCoreRequestType, frames: list[Any]) -> None:
        """Sends an encoded message (any thread: the socket is used under ``send_lock``)."""
        self.ensure_alive()
        size = sum(memoryview(frame).nbytes for frame in frames)
        if size > self.settings.max_frame_bytes:  # the engine would refuse it (and drop the connection)
            raise EngineClientUsageError(
                f"The {request_type.name} message is {size} bytes, over max_frame_bytes="
                f"{self.settings.max_frame_bytes} (VLLITE_ENGINE_MAX_FRAME_BYTES)."
            )
        with self.resources.send_lock:
            socket = self.resources.input_socket
            if socket is None:
                raise EngineClientClosedError("The engine client has been shut down.")
            deadline = time.monotonic() + _RECONNECT_GRACE_S
            # Sent frame by frame: a Ctrl-C in between would leave half a message, which corrupts the next one.
            send = functools.partial(socket.send_multipart, (self.core_engine, request_type.value, *frames), copy=False)
            while True:
                try:
                    sigint_deferred(send)
                    return
                except zmq.ZMQError as exc:  # EHOSTUNREACH: the engine's socket is gone
                    if exc.errno != zmq.EHOSTUNREACH:
                        raise
                    # The engine drops its connection on an oversized frame (MAXMSGSIZE) and reconnects at once.
                    exited = peek_exit_code(self.resources.proc) is not None
                    if time.monotonic() > deadline or self.resources.engine_dead or exited:
                        raise EngineDeadError(f"The engine core is unreachable: {exc}") from None
                time.sleep(0.005)

    def _new_utility_future(self, method: str) -> tuple[int, Future]:
        if method not in UTILITY_METHODS:
            raise ValueError(
                f"Unknown or disallowed engine utility {method!r}; allowed: {', '.join(sorted(UTILITY_METHODS))}."
            )
        call_id = next(self._call_ids)
        future: Future = Future()
        with self.resources.send_lock:
            if self.resources.engine_dead:
                raise self.resources.dead_error()
            self.utility_results[call_id] = future
        return call_id, future

    def _send_utility(self, method: str, args: tuple[Any, ...]) -> Future:
        call_id, future = self._new_utility_future(method)
        try:
            self._send_input(EngineCoreRequestType.UTILITY, (self.client_index, call_id, method, list(args)))
        except BaseException:
            self.utility_results.pop(call_id, None)
            raise
        return future

    # ------------------------------------------------------------------ requests (blocking; also for AsyncMPClient)
    def add_request(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        self._send_input(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead and not self.resources.closed:
            self._send_input(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any) -> Any:
        """Calls an allow-listed engine method in the engine process and waits for its result."""
        return self._send_utility(method, args).result()

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stops the output thread and the engine process and removes sockets; idempotent.

        Every caller still waiting on this client (a blocked ``get_output()`` or ``get_output_async()``, a utility
        call) wakes first, with ``EngineClientClosedError``, so none waits out the process's exit (or a hung one).
        """
        if not self.resources.closed:
            closed = EngineClientClosedError("The engine client was shut down while this call was waiting.")
            _fail_pending(self.resources, self.utility_results, closed)
            self._make_output_sink()(closed)
        self._finalizer()

    @property
    def is_engine_dead(self) -> bool:
        return self.resources.engine_dead


def _startup_failure(proc: Any, handshake: zmq.Socket, failure: EngineErrorCause | None) -> EngineStartupError:
    """The error for an engine process that exited during start-up: the cause it reported, else how it ended (a
    signal: no hint about the script; an exit without a report: the ``__main__`` guard hint)."""
    proc.join(timeout=1.0)
    while failure is None and handshake.poll(timeout=200):  # the child's report may trail its exit
        failure = _decode_failure(handshake.recv_multipart()[-1])
    if failure is not None:
        return EngineStartupError(
            f"Engine core initialization failed: {failure.describe()} (exit code {proc.exitcode})."
        )
    signal_name = exit_signal_name(proc.exitcode)
    if signal_name is not None:
        return EngineStartupError(
            f"Engine core initialization failed: the engine process was stopped by {signal_name}."
        )
    return EngineStartupError(
        f"Engine core initialization failed (exit code {proc.exitcode}); see the root cause above. "
        "If the engine was given a class defined in your script itself, the engine process imports "
        'the script: guard its top-level code with `if __name__ == "__main__":`.'
    )


def _decode_failure(payload: bytes) -> EngineErrorCause | None:
    try:
        return msgspec.msgpack.decode(payload, type=HandshakeFailure).error
    except msgspec.DecodeError:
        return None


def _engine_entry(*args: Any, **kwargs: Any) -> None:
    from .entry import run_engine_core

    run_engine_core(*args, **kwargs)


def _log_level() -> int:
    level = logging.getLogger("vllite").getEffectiveLevel()
    return level if level != logging.NOTSET else logging.INFO


class SyncMPClient(MPClient):
    """The default engine client of ``LLM``/``LLMEngine``: blocking calls over an output queue."""

    def __init__(self, config: EngineConfig, *, log_stats: bool | None = None, executor_class: type | None = None):
        self.outputs_queue: queue.Queue[EngineCoreOutputs | BaseException] = queue.Queue()
        super().__init__(config, log_stats=log_stats, executor_class=executor_class)

    def _make_output_sink(self) -> Callable[[EngineCoreOutputs | BaseException], None]:
        return self.outputs_queue.put_nowait

    def get_output(self) -> EngineCoreOutputs:
        """Blocks for the next outputs; raises ``EngineDeadError`` (sticky) once the engine has died.

        It waits in slices: Python runs a signal's handler in the main thread only, between bytecodes, and a Ctrl-C
        that the kernel hands to another thread would otherwise wait for the engine's next output."""
        if self.resources.engine_dead and self.outputs_queue.empty():
            raise self.resources.dead_error()
        while True:
            try:
                outputs = self.outputs_queue.get(timeout=_SIGNAL_CHECK_INTERVAL_S)
                break
            except queue.Empty:
                continue
        if isinstance(outputs, BaseException):
            self.outputs_queue.put_nowait(outputs)  # keep it for every later (or concurrent) caller
            if self.resources.engine_dead:
                raise self.resources.dead_error() from None
            raise outputs
        return outputs
