"""The client's output thread: decode engine outputs, answer utility futures, detect engine death and hangs.

A live engine sends something (outputs or a heartbeat) at least every ``heartbeat_interval_s``; after
``heartbeat_timeout_s`` of silence the engine is declared hung: every waiting call fails with ``EngineDeadError``
and the process is killed.

The thread body refers only to the client's ``BackgroundResources``, queues and futures, never to the client
itself, so an unreferenced client can still be garbage-collected (its finalizer then stops this thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from vllite.exceptions import EngineDeadError, UtilityCallError
from vllite.plugins.engine_proc.serial import MsgpackDecoder
from vllite.protocol import EngineCoreOutputs

from .utils import exit_signal_name, peek_exit_code

logger = logging.getLogger(__name__)


def process_outputs_socket(
    resources: Any,
    out_socket: zmq.Socket,
    shutdown_path: str,
    proc_sentinel: int,
    utility_results: dict[int, Future],
    sink: Callable[[EngineCoreOutputs | BaseException], None],
    started: threading.Event,
) -> None:
    """The client's output thread: decode outputs, resolve utility futures, detect engine death (no ``self``)."""
    decoder = MsgpackDecoder(EngineCoreOutputs)
    shutdown_socket = resources.ctx.socket(zmq.PAIR)
    hung = False
    try:
        shutdown_socket.bind(shutdown_path)
        started.set()
        poller = zmq.Poller()
        poller.register(shutdown_socket, zmq.POLLIN)
        poller.register(out_socket, zmq.POLLIN)
        poller.register(proc_sentinel, zmq.POLLIN)
        timeout_s = resources.heartbeat_timeout_s
        last_heard = time.monotonic()
        while True:
            events = dict(poller.poll(timeout=max(1, int((last_heard + timeout_s - time.monotonic()) * 1000) + 1)))
            if shutdown_socket in events:
                break
            if not events:
                silent_s = time.monotonic() - last_heard
                if silent_s < timeout_s:
                    continue
                hung = True
                raise resources.mark_dead(
                    f"The engine core is unresponsive: no message (not even a heartbeat) for {silent_s:.1f} s "
                    f"(heartbeat timeout {timeout_s:g} s, VLLITE_ENGINE_HEARTBEAT_TIMEOUT_S); its process was killed."
                )
            if out_socket in events:
                last_heard = time.monotonic()
                _handle_output_frames(out_socket.recv_multipart(copy=False), resources, decoder, utility_results, sink)
            elif proc_sentinel in events:
                # The process exited: deliver what it sent before dying, then declare it dead.
                while out_socket.poll(timeout=0):
                    _handle_output_frames(
                        out_socket.recv_multipart(copy=False), resources, decoder, utility_results, sink
                    )
                if resources.closed:
                    break
                message, on_request = _exit_message(resources.proc)
                resources.stopped_on_request = on_request
                raise resources.mark_dead(message)
    except BaseException as exc:
        if isinstance(exc, EngineDeadError) or resources.engine_dead:
            if not isinstance(exc, EngineDeadError):
                resources.mark_dead(f"The engine core died: {type(exc).__name__}: {exc}")
            if resources.stopped_on_request:  # SIGTERM to the process group (docker stop): not a death
                logger.info("%s", resources.dead_message)
            else:
                logger.error("Engine core died: %s", resources.dead_message)
            exc = resources.dead_error()
        elif resources.closed:
            return
        else:
            logger.exception("The engine client's output thread failed")
        _fail_pending(resources, utility_results, exc)
        sink(exc)
    finally:
        if hung and not resources.closed:
            resources.kill_hung_process()  # a hung (or stopped) engine
        started.set()
        shutdown_socket.close(linger=0)
        out_socket.close(linger=0)


def _exit_message(proc: Any) -> tuple[str, bool]:
    """Why a process that exited without a word is gone, and whether it was told to stop: exit code 0 is the
    engine's own clean exit after a shutdown request (SIGTERM: the drain, then exit), and SIGTERM's exit code
    (killed by it, or ``128 + 15`` while starting) is that signal too. Anything else is an unexpected death: the
    signal that killed it, else its exit code."""
    if proc is None:  # an engine another frontend started (--api-server-count): its exit code is not ours to read
        return "The engine core process (started by API server 0) exited unexpectedly; see its log above.", False
    deadline = time.monotonic() + 1.0  # its sentinel fires as it exits, a moment before it can be reaped
    exitcode = peek_exit_code(proc)  # never reaps: that is the owner's join, on another thread
    while exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
        exitcode = peek_exit_code(proc)
    signal_name = exit_signal_name(exitcode)
    if exitcode == 0 or signal_name == "SIGTERM":
        how = "exit code 0" if exitcode == 0 else f"ended by {signal_name}"
        return (
            f"The engine core process shut down on request ({how}: it received SIGTERM or a shutdown request); "
            "this client serves no more requests.",
            True,
        )
    if signal_name is not None:
        return f"The engine core process died unexpectedly: it was killed by {signal_name}.", False
    message = f"The engine core process died unexpectedly (exit code {exitcode}); see its log above for the cause."
    return message, False


def _handle_output_frames(
    frames: list[Any],
    resources: Any,
    decoder: MsgpackDecoder,
    utility_results: dict[int, Future],
    sink: Callable[[EngineCoreOutputs | BaseException], None],
) -> None:
    if resources.validate_alive(frames):
        return  # a heartbeat
    outputs: EngineCoreOutputs = decoder.decode(frames)
    if outputs.utility_output is not None:
        output = outputs.utility_output
        future = utility_results.pop(output.call_id, None)
        if future is None:
            logger.warning("Utility answer for unknown call id %d", output.call_id)
        elif not future.done():
            if output.failure_message is not None:
                future.set_exception(UtilityCallError(output.failure_message))
            else:
                future.set_result(output.result.result if output.result is not None else None)
        if not outputs.outputs:
            return
    sink(outputs)


def _fail_pending(resources: Any, utility_results: dict[int, Future], exc: BaseException) -> None:
    with resources.send_lock:
        pending = list(utility_results.values())
        utility_results.clear()
    for future in pending:
        if not future.done():
            future.set_exception(exc if isinstance(exc, Exception) else EngineDeadError())
