"""The engine-core child process: entry point, signal handling and parent-death watch.

``run_engine_core`` is the ``multiprocessing`` (spawn) target. Before torch loads it resolves the CPU-thread
plan (``VLLITE_CPU_OMP_THREADS_BIND``, see ``vllite.platform.cpu_threads``) and sets the
OpenMP variables it implies.
Plugins are loaded in the child by the plugin manager on first use, from the ``sys.path`` and environment the
parent passed on, so a scheduler or logits processor from a third-party distribution works across the process
boundary.

SIGTERM requests a shutdown (RUNNING → REQUESTED). SIGINT is ignored: a terminal's Ctrl-C goes to the whole
foreground process group, and it is the frontend's to handle (the client aborts its requests and the engine serves
the next call, or the frontend shuts the engine down with SIGTERM). The client starts this process with SIGINT
blocked (``spawning.sigint_blocked``), so one that comes before ``run_engine_core`` ignores it is held, then
discarded.

The pipe a watcher thread selects on is installed as the signal wakeup fd (``signal.set_wakeup_fd``), so CPython's
C-level handler writes the signal number to it the moment the signal arrives, whichever thread receives it; the
watcher then wakes the busy loop (touching ``queue.Queue`` inside a signal handler could deadlock on its lock). The
Python-level handler is not relied on for that: it runs only when the main thread next checks for pending signals,
and a main thread that goes idle in ``input_queue.get()`` around the time the signal arrives can block without
running it, which left the engine running until the client killed it. If the parent process dies, the same watcher
requests an immediate shutdown (drain timeout 0).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, NoReturn

from vllite.config import EngineConfig
from vllite.logging_utils import tracebacks_enabled
from vllite.platform.cpu_threads import CpuThreadPlan

if TYPE_CHECKING:
    from .core_proc import EngineCoreProc

logger = logging.getLogger(__name__)


def _setup_child(sys_path: list[str], env: dict[str, str], log_level: int) -> None:
    for entry in reversed(sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=log_level, format="%(levelname)s %(asctime)s [EngineCore pid=%(process)d] %(message)s"
        )
    root.setLevel(log_level)
    from vllite.logging_utils import hide_tracebacks_if_requested

    hide_tracebacks_if_requested(root.handlers)  # the `vllite` CLI without --debug: the cause reaches it as a value
    try:  # tqdm's default lock is a named multiprocessing semaphore registered with the parent's resource
        # tracker: a SIGKILLed engine would leave it in /dev/shm until the parent exits. One process needs none.
        import tqdm

        tqdm.tqdm.set_lock(threading.RLock())
    except ImportError:
        pass
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle("vllite::EngineCore")
    except ImportError:
        pass


def _prepare_cpu_threads() -> CpuThreadPlan:
    """Resolves the CPU-thread plan of this process (``vllite.platform.cpu_threads``) and, before torch loads,
    the OpenMP variables it implies; a variable set by the user wins. A bad value fails the start-up, naming the
    variable."""
    from vllite.platform.cpu_threads import resolve_plan

    plan = resolve_plan()
    for key, value in plan.spawn_env().items():
        os.environ.setdefault(key, value)
    return plan


def _confine_to_bound_cpus() -> None:
    """A data-parallel engine given a CPU list keeps every thread on it (its I/O threads too, rather than on the
    CPUs of the other engines); before any thread starts, so they all inherit the mask."""
    from vllite.platform.cpu_threads import BIND_ENV, parse_cpu_list

    bind = os.environ.get(BIND_ENV, "").strip()
    if not bind or bind in ("auto", "nobind") or "|" in bind:
        return
    try:
        cpus = set(parse_cpu_list(bind)) & os.sched_getaffinity(0)
    except ValueError:
        return  # resolve_plan() reports the bad value, naming the variable
    if cpus:
        os.sched_setaffinity(0, cpus)


class _Watcher:
    """Turns signals and the parent's death into shutdown requests, outside any signal handler."""

    def __init__(self, parent_conn: Any) -> None:
        self.engine: Any = None
        self._parent_conn = parent_conn
        self.parent_gone = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._thread = threading.Thread(target=self._run, name="EngineCoreWatcher", daemon=True)
        self._thread.start()

    def install(self) -> None:
        """Main thread only: routes SIGTERM to the watcher's pipe at C level, and to ``on_signal``; ignores SIGINT
        (and discards one held while the process started)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self.on_signal)

    @staticmethod
    def uninstall() -> None:
        """Back to the default SIGTERM (SIGINT stays ignored while the process exits)."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)

    def on_signal(self, signum: int, frame: Any) -> None:
        # The wakeup fd has already told the watcher; this (main-thread) handler only aborts a start-up.
        if self.engine is None:
            raise SystemExit(128 + signum)  # still starting up: stop loading right away

    def _run(self) -> None:
        fds = [self._read_fd]
        if self._parent_conn is not None:
            fds.append(self._parent_conn.fileno())
        while True:
            readable, _, _ = select.select(fds, [], [])
            if self._read_fd in readable:
                signums = os.read(self._read_fd, 64)  # one byte per signal, written by CPython's C handler
                if self.engine is not None and signal.SIGTERM in signums:
                    logger.info("Shutdown requested by signal")
                    self.engine.request_shutdown()
            if self._parent_conn is not None and self._parent_conn.fileno() in readable:
                try:
                    self._parent_conn.recv_bytes()
                    continue  # unexpected data: ignore
                except (EOFError, OSError):
                    pass
                logger.warning("The frontend process is gone; shutting down the engine core")
                self.parent_gone = True
                fds.remove(self._parent_conn.fileno())
                if self.engine is not None:
                    self.engine.request_shutdown(drain_timeout_s=0)
                else:
                    os.kill(os.getpid(), signal.SIGTERM)


def run_engine_core(
    config: EngineConfig,
    handshake_address: str,
    parent_conn: Any = None,
    sys_path: list[str] | None = None,
    env: dict[str, str] | None = None,
    log_level: int = logging.INFO,
    engine_index: int = 0,
    executor_class: type | None = None,
    log_stats: bool | None = None,
    curve_server_key: bytes | None = None,
    env_overrides: dict[str, str] | None = None,
) -> None:
    """Child-process entry: builds ``EngineCoreProc`` (which performs the handshake) and runs its busy loop.

    ``env_overrides`` replace inherited variables (a data-parallel engine's own CPU list); with
    ``data_parallel_size > 1`` the engine is a ``DPEngineCoreProc``."""
    os.environ.update(env_overrides or {})
    _setup_child(sys_path or [], env or {}, log_level)
    if config.parallel_config.data_parallel_size > 1:
        _confine_to_bound_cpus()
    proc_class = _engine_core_class(config)
    watcher = _Watcher(parent_conn)
    watcher.install()
    engine_core: EngineCoreProc | None = None
    exit_code = 0
    try:
        cpu_plan = _prepare_cpu_threads()
        engine_core = proc_class(
            config,
            handshake_address,
            cpu_plan=cpu_plan,
            executor_class=executor_class,
            log_stats=log_stats,
            engine_index=engine_index,
            curve_server_key=curve_server_key,
        )
        watcher.engine = engine_core
        engine_core.run_busy_loop()
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 0
        if engine_core is not None:
            engine_core.stop_output_thread()
    except BaseException as exc:
        exit_code = 1
        _report_fatal_error(engine_core, exc, handshake_address, curve_server_key)
    finally:
        watcher.uninstall()
        if engine_core is not None:
            try:
                engine_core.shutdown()
            except Exception:
                logger.exception("EngineCore shutdown failed")
    if watcher.parent_gone:  # nobody else will remove the frontend's private IPC directory
        _remove_ipc_dir(handshake_address)
    _exit_now(exit_code)


def _engine_core_class(config: EngineConfig) -> type[EngineCoreProc]:
    """``DPEngineCoreProc`` with ``data_parallel_size > 1``, else ``EngineCoreProc``."""
    from .core_proc import EngineCoreProc

    if config.parallel_config.data_parallel_size > 1:
        from .dp_core_proc import DPEngineCoreProc

        return DPEngineCoreProc
    return EngineCoreProc


def _report_fatal_error(
    engine_core: EngineCoreProc | None, exc: BaseException, handshake_address: str, curve_server_key: bytes | None
) -> None:
    """Logs ``exc`` with its traceback (call it from the ``except`` block) and tells the frontend: a start-up
    failure on the handshake socket while there is no ``engine_core`` yet, else the engine's death. A start-up
    failure is not logged where tracebacks are off (the CLI without ``--debug``): the frontend prints its cause,
    and once is enough."""
    if engine_core is None:
        if tracebacks_enabled():
            logger.exception("EngineCore failed to start.")
        report_startup_failure(handshake_address, exc, curve_server_key=curve_server_key)
    else:
        logger.exception("EngineCore encountered a fatal error.")
        engine_core.send_engine_dead(exc)


def _remove_ipc_dir(handshake_address: str) -> None:
    """Removes the frontend's private IPC directory, where ``handshake_address`` is in one."""
    from .utils import ipc_dir_of

    directory = ipc_dir_of(handshake_address)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def _exit_now(exit_code: int) -> NoReturn:
    """Ends the process with ``exit_code`` once logs and standard streams are flushed."""
    # Skip interpreter teardown (seconds with torch loaded): everything that matters is flushed or closed. The
    # multiprocessing finalizers still run: they unlink named semaphores created here (tqdm's lock, made while
    # loading weights, registers with the parent's resource tracker, which otherwise reports it as leaked).
    _run_multiprocessing_finalizers()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(exit_code)


def report_startup_failure(
    handshake_address: str, exc: BaseException, timeout_s: float = 2.0, curve_server_key: bytes | None = None
) -> None:
    """Sends FAILED with the exception's type and message to the frontend's handshake socket (best effort), so
    the client raises ``EngineStartupError`` naming the real cause."""
    import msgspec
    import zmq

    from .utils import EngineErrorCause, HandshakeFailure, make_socket

    ctx = zmq.Context()
    try:
        socket = make_socket(
            ctx, zmq.DEALER, linger=int(timeout_s * 1000), unlimited_hwm=False, curve_server_key=curve_server_key
        )
        socket.connect(handshake_address)
        status = HandshakeFailure(EngineErrorCause.from_exception(exc))
        socket.send(msgspec.msgpack.encode(status), zmq.NOBLOCK)
        socket.close()
    except Exception:
        logger.exception("Could not report the start-up failure (%s: %s) to the frontend", type(exc).__name__, exc)
    finally:
        ctx.term()


def _run_multiprocessing_finalizers() -> None:
    try:
        from multiprocessing import util

        # What a normal process exit runs (``util._exit_function``), minus joining children. Private, so typeshed
        # does not declare it.
        util._run_finalizers()  # type: ignore[attr-defined]
    except Exception:
        logger.exception("Running the multiprocessing finalizers failed")
