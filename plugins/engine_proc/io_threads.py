"""The engine process's I/O threads: decode client frames into a queue, and encode outputs onto sockets.

``EngineIOThreads`` owns the two queues between the threads and the busy loop. Frames are decoded by msgspec into
the expected types only; oversized or malformed frames are logged (rate-limited) and dropped. An ADD request is
preprocessed (its blocks hashed) on the input thread, off the busy loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from vllite.exceptions import EngineStartupError
from vllite.plugins.engine_proc.serial import DecodeError, MsgpackDecoder, MsgpackEncoder
from vllite.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineInfo,
    FinishReason,
)
from vllite.request import Request

from .utils import ENGINE_CORE_DEAD, ENGINE_CORE_HEARTBEAT, EngineErrorCause, ProcSettings, make_socket

logger = logging.getLogger(__name__)

# (client_index, call_id, method_name, positional args)
UtilityCall = tuple[int, int, str, list[Any]]
OUTPUT_STOP = object()


class _EngineDeadNotice:
    """The output queue's last item after a fatal error: ``ENGINE_CORE_DEAD`` and the encoded cause."""

    def __init__(self, cause: EngineErrorCause) -> None:
        self.payload = msgspec.msgpack.encode(cause)


_CLIENT_REQUEST_TYPES = (
    EngineCoreRequestType.ADD,
    EngineCoreRequestType.ABORT,
    EngineCoreRequestType.UTILITY,
    EngineCoreRequestType.START_DP_WAVE,
)


class DropLog:
    """Logs dropped frames without flooding: the first ``burst`` of them, then every ``every``-th."""

    def __init__(self, burst: int = 10, every: int = 1000) -> None:
        self.count = 0
        self.burst = burst
        self.every = every

    def __call__(self, reason: str, *args: Any) -> None:
        self.count += 1
        if self.count <= self.burst or self.count % self.every == 0:
            logger.warning("Dropped input frame #%d: " + reason, self.count, *args)


class EngineIOThreads:
    """The input and output threads of one engine process, and the queues that connect them to its busy loop.

    ``input_queue`` holds ``(EngineCoreRequestType, payload)`` for the busy loop; ``output_queue`` holds
    ``(client_index, EngineCoreOutputs)`` (or an engine-dead notice / ``OUTPUT_STOP``) for the output thread,
    which also sends ``ENGINE_CORE_HEARTBEAT`` to every client when it has sent nothing for
    ``settings.heartbeat_interval_s`` (on its own timer, so heartbeats flow during long steps too).
    """

    def __init__(
        self, settings: ProcSettings, num_clients: int, preprocess: Callable[[EngineCoreRequest], Request]
    ) -> None:
        self.settings = settings
        self.num_clients = num_clients
        self.preprocess = preprocess
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.dropped_frames = DropLog()
        self._zmq_ctx = zmq.Context()
        self.input_thread: threading.Thread | None = None
        self.output_thread: threading.Thread | None = None

    def start(
        self,
        input_addresses: list[str],
        output_addresses: list[str],
        identity: bytes,
        info: EngineInfo,
        engine_index: int,
    ) -> None:
        """Starts both threads; returns once the input sockets have announced the engine (``info``)."""
        ready_event = threading.Event()
        self.input_thread = threading.Thread(
            target=self.process_input_sockets,
            args=(input_addresses, identity, msgspec.msgpack.encode(info), ready_event),
            name="EngineCoreInput",
            daemon=True,
        )
        self.input_thread.start()
        self.output_thread = threading.Thread(
            target=self.process_output_sockets,
            args=(output_addresses, engine_index),
            name="EngineCoreOutput",
            daemon=True,
        )
        self.output_thread.start()
        while not ready_event.wait(timeout=10):
            if not self.input_thread.is_alive():
                raise EngineStartupError("The engine's input socket thread died during start-up.")

    def send_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        for item in outputs.items():
            self.output_queue.put_nowait(item)

    def send_finish_outputs(
        self, req_ids: list[str], client_index: int, reason: FinishReason, error: str | None = None
    ) -> None:
        """Finishes requests the engine never ran (rejected, or arriving during shutdown); ``error`` says why."""
        outputs = [EngineCoreOutput(req_id, [], finish_reason=reason, error=error) for req_id in req_ids]
        self.output_queue.put_nowait((client_index, EngineCoreOutputs(outputs=outputs, finished_requests=set(req_ids))))

    def send_engine_dead(self, cause: BaseException | None = None) -> None:
        """Sends ``ENGINE_CORE_DEAD`` + the cause to every client and waits for the output thread to finish."""
        if cause is None:
            cause = RuntimeError("unknown cause")
        self.output_queue.put_nowait(_EngineDeadNotice(EngineErrorCause.from_exception(cause)))
        if self.output_thread is not None:
            self.output_thread.join(timeout=5.0)
            if self.output_thread.is_alive():
                logger.critical("The engine-dead notice could not be sent; the ZMQ connection may be broken.")

    def stop_output_thread(self, timeout: float = 5.0) -> None:
        """Lets the output thread flush what is queued, close its sockets and exit (clean shutdown)."""
        thread = self.output_thread
        if thread is not None and thread.is_alive():
            self.output_queue.put_nowait(OUTPUT_STOP)
            thread.join(timeout=timeout)

    def process_input_sockets(
        self, input_addresses: list[str], identity: bytes, ready: bytes, ready_event: threading.Event
    ) -> None:
        """Input thread: announces the engine (``ready``: its ``EngineInfo``) on every input socket, then decodes
        and queues client messages."""
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityCall),
            # Data parallel in lockstep: (wave, index of the engine that need not be told).
            EngineCoreRequestType.START_DP_WAVE: MsgpackDecoder(tuple[int, int]),
        }
        poller = zmq.Poller()
        monitors: dict[zmq.Socket, tuple[zmq.Socket, str]] = {}

        def connect(address: str, announce: bytes | None) -> None:
            socket = make_socket(
                self._zmq_ctx,
                zmq.DEALER,
                identity=identity,
                linger=0,
                max_msg_size=self.settings.max_frame_bytes,
                curve_server_key=self.settings.curve_server_key,
            )
            monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            socket.connect(address)
            if announce is not None:
                socket.send(announce)  # a DEALER must speak first before the client's ROUTER can route to it
            poller.register(socket, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            monitors[monitor] = (socket, address)

        for address in input_addresses:
            connect(address, ready)
        ready_event.set()
        while True:
            for socket, _ in poller.poll():
                if socket in monitors:
                    if recv_monitor_message(socket)["event"] == zmq.EVENT_DISCONNECTED:
                        # A frame over MAXMSGSIZE is a protocol error: libzmq drops the connection for good without
                        # buffering the frame. Reconnect on a fresh socket (the client's ROUTER hands the identity
                        # over); the announcement is not repeated.
                        data_socket, address = monitors.pop(socket)
                        self.dropped_frames(
                            "connection from %s dropped (a frame over MAXMSGSIZE, or the client exited); reconnecting",
                            address,
                        )
                        for closing in (socket, data_socket):
                            poller.unregister(closing)
                        data_socket.disable_monitor()
                        socket.close(linger=0)
                        data_socket.close(linger=0)
                        connect(address, None)
                    continue
                self._handle_input_frames(socket.recv_multipart(copy=False), decoders)

    def _handle_input_frames(self, frames: list[Any], decoders: dict[EngineCoreRequestType, MsgpackDecoder]) -> None:
        size = sum(len(frame.buffer) if hasattr(frame, "buffer") else len(frame) for frame in frames)
        if size > self.settings.max_frame_bytes:
            self.dropped_frames("message of %d bytes exceeds max_frame_bytes=%d", size, self.settings.max_frame_bytes)
            return
        if len(frames) < 2:
            self.dropped_frames("%d frame(s), expected a type frame and a payload", len(frames))
            return
        type_bytes = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0])
        try:
            request_type = EngineCoreRequestType(type_bytes)
        except ValueError:
            self.dropped_frames("unknown request type %r", type_bytes[:8])
            return
        if request_type not in _CLIENT_REQUEST_TYPES:
            self.dropped_frames("request type %s is not accepted from clients", request_type.name)
            return
        try:
            payload = decoders[request_type].decode(frames[1:])
        except DecodeError as exc:
            self.dropped_frames("malformed %s payload: %s", request_type.name, exc)
            return
        except Exception as exc:  # never let one frame kill the input thread
            self.dropped_frames("undecodable %s payload: %s: %s", request_type.name, type(exc).__name__, exc)
            return
        if request_type == EngineCoreRequestType.ADD:
            self._queue_add(payload)
        elif request_type in (EngineCoreRequestType.ABORT, EngineCoreRequestType.START_DP_WAVE):
            self.input_queue.put_nowait((request_type, payload))
        else:
            if not 0 <= payload[0] < self.num_clients:
                self.dropped_frames("utility call for unknown client %d", payload[0])
                return
            self.input_queue.put_nowait((request_type, payload))

    def _queue_add(self, request: EngineCoreRequest) -> None:
        if not 0 <= request.client_index < self.num_clients:
            self.dropped_frames("request %r for unknown client %d", request.request_id, request.client_index)
            return
        try:
            preprocessed = self.preprocess(request)
        except Exception as exc:
            cause = f"the engine could not prepare the request: {type(exc).__name__}: {exc}"
            logger.error("Preprocessing request %r failed: %s", request.request_id, cause)
            self.send_finish_outputs([request.request_id], request.client_index, FinishReason.ERROR, cause)
            return
        self.input_queue.put_nowait((EngineCoreRequestType.ADD, preprocessed))

    def process_output_sockets(self, output_addresses: list[str], engine_index: int) -> None:
        """Output thread: encodes outputs into reused buffers and pushes them to the owning client."""
        ctx = zmq.Context()  # its own context, terminated here, so lingering messages are flushed on exit
        encoder = MsgpackEncoder()
        sockets = []
        for address in output_addresses:
            socket = make_socket(ctx, zmq.PUSH, linger=4000, curve_server_key=self.settings.curve_server_key)
            socket.connect(address)
            sockets.append(socket)
        reuse_buffers: list[bytearray] = []
        pending: deque[tuple[zmq.MessageTracker, Any, bytearray]] = deque()
        max_reuse = len(sockets) + 1
        interval = self.settings.heartbeat_interval_s
        last_sent = time.monotonic()
        try:
            while True:
                try:
                    item = self.output_queue.get(timeout=max(0.0, last_sent + interval - time.monotonic()))
                except queue.Empty:
                    for socket in sockets:
                        socket.send(ENGINE_CORE_HEARTBEAT)
                    last_sent = time.monotonic()
                    continue
                if item is OUTPUT_STOP:
                    break
                if isinstance(item, _EngineDeadNotice):
                    for socket in sockets:
                        socket.send_multipart([ENGINE_CORE_DEAD, item.payload])
                    break
                last_sent = time.monotonic()
                client_index, outputs = item
                if not 0 <= client_index < len(sockets):
                    logger.error("Dropping outputs for unknown client %d", client_index)
                    continue
                outputs.engine_index = engine_index
                while pending and pending[-1][0].done:
                    buffer = pending.pop()[2]
                    if len(reuse_buffers) < max_reuse:
                        reuse_buffers.append(buffer)
                buffer = reuse_buffers.pop() if reuse_buffers else bytearray()
                try:
                    frames = encoder.encode_into(outputs, buffer)
                except BufferError:  # still exported by a zmq frame: use a fresh one
                    buffer = bytearray()
                    frames = encoder.encode_into(outputs, buffer)
                tracker = _send_frames(sockets[client_index], frames)
                if tracker is None or tracker.done:
                    if len(reuse_buffers) < max_reuse:
                        reuse_buffers.append(buffer)
                else:
                    pending.appendleft((tracker, outputs, buffer))
        finally:
            for socket in sockets:
                socket.close(linger=4000)
            ctx.term()


def _send_frames(socket: zmq.Socket, frames: list[Any]) -> zmq.MessageTracker | None:
    """Sends ``[main, *aux]`` zero-copy and returns the tracker of the main (reused) buffer."""
    last = len(frames) - 1
    tracker = socket.send(frames[0], zmq.SNDMORE if last else 0, copy=False, track=True)
    for i, frame in enumerate(frames[1:], start=1):
        socket.send(frame, zmq.SNDMORE if i < last else 0, copy=False)
    return tracker
