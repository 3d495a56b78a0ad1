"""``BackgroundResources``: what one engine client owns outside Python objects, and its release.

The ZMQ context and sockets, the socket directory, the engine process and the output thread. Calling it (the
``weakref.finalize`` callback of the client, ``shutdown()``, or interpreter exit) stops the engine and the thread
and removes the sockets; it also holds the engine's death state, which every call of the client checks.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from vllite.exceptions import EngineDeadError

from .utils import ENGINE_CORE_DEAD, ENGINE_CORE_HEARTBEAT, EndpointFactory, EngineErrorCause, peek_exit_code

logger = logging.getLogger(__name__)


@dataclass
class BackgroundResources:
    """Everything the client owns outside Python objects; calling it releases all of it (idempotent).

    Used as the ``weakref.finalize`` callback, so it must not refer back to the client.
    """

    ctx: zmq.Context | None = None
    endpoints: EndpointFactory | None = None
    input_socket: zmq.Socket | None = None
    output_socket: zmq.Socket | None = None
    proc: Any = None
    parent_conn: Any = None
    shutdown_path: str | None = None
    output_thread: threading.Thread | None = None
    shutdown_timeout_s: float = 0.0
    heartbeat_timeout_s: float = 60.0
    engine_dead: bool = False
    dead_message: str | None = None
    stopped_on_request: bool = False  # the engine exited because it was told to (SIGTERM), not a crash
    closed: bool = False
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self) -> None:
        if self.closed:
            return
        self.closed = True
        # The engine first, while the output socket is still open: a draining (or aborting) engine flushes its
        # last outputs to it before exiting; were it closed, the engine's PUSH socket would linger on them for
        # seconds. The output thread sees the process exit (``closed`` is set), delivers what arrived, and stops.
        self._stop_process()
        self._stop_output_thread()
        with self.send_lock:
            for socket in (self.input_socket, self.output_socket):
                if socket is not None and not socket.closed:
                    socket.close(linger=0)
            self.input_socket = self.output_socket = None
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None
        if self.endpoints is not None:
            self.endpoints.cleanup()

    def _stop_output_thread(self) -> None:
        thread = self.output_thread
        if thread is None or not thread.is_alive() or self.ctx is None or self.shutdown_path is None:
            return
        wake = self.ctx.socket(zmq.PAIR)
        try:
            wake.connect(self.shutdown_path)
            wake.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            wake.close(linger=0)
        if thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _stop_process(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.is_alive():
            proc.terminate()  # SIGTERM: the engine drains for shutdown_timeout_s, then exits
            proc.join(timeout=self.shutdown_timeout_s + 5.0)
        if proc.is_alive():
            logger.warning("Engine core process %d did not exit in time; killing it", proc.pid)
            proc.kill()
            proc.join(timeout=5.0)
        if self.parent_conn is not None:
            self.parent_conn.close()
            self.parent_conn = None

    def dead_error(self) -> EngineDeadError:
        """The (sticky) error every call raises once the engine is dead: it names the cause when one is known."""
        if self.dead_message is None:
            return EngineDeadError(suppress_context=True)
        return EngineDeadError(self.dead_message, suppress_context=True)

    def mark_dead(self, message: str) -> EngineDeadError:
        """Records the engine's death (the first cause wins) and returns the error to raise."""
        if not self.engine_dead or self.dead_message is None:
            self.dead_message = message
        self.engine_dead = True
        return self.dead_error()

    def validate_alive(self, frames: list[Any]) -> bool:
        """Raises ``EngineDeadError`` (with the engine's cause) on ``ENGINE_CORE_DEAD``; True for a heartbeat."""
        first = frames[0].bytes if frames else b""
        if first == ENGINE_CORE_HEARTBEAT and len(frames) == 1:
            return True
        if first == ENGINE_CORE_DEAD and len(frames) <= 2:
            cause = "unknown cause"
            if len(frames) == 2:
                try:
                    cause = msgspec.msgpack.decode(frames[1].bytes, type=EngineErrorCause).describe()
                except msgspec.DecodeError:
                    cause = "undecodable cause"
            raise self.mark_dead(f"The engine core died: {cause}")
        return False

    def kill_hung_process(self) -> None:
        """Kills an unresponsive engine process (SIGKILL also ends a stopped one); the sockets stay for cleanup."""
        proc = self.proc
        if proc is not None and peek_exit_code(proc) is None:
            proc.kill()
