"""``vllite serve --api-server-count N`` (vLLM's ``-asc``): N API-server processes in front of one engine process.

The ``vllite serve`` process is API server 0: it binds the listening socket, starts the engine (asking it to serve
N clients, see ``engine_proc/shared_engine.py``) and spawns API servers 1..N-1. Each gets the same listening
socket (the kernel hands every new connection to one of the processes accepting on it), the same flags and the
engine's config, joins the engine as client ``i`` with its own ``AsyncLLM`` (tokenizer, output processor), and
reports ready; API server 0 prints its banner once all are. Every response carries ``x-vllite-api-server: i``
(with N > 1) so a client can tell which process answered.

Shutdown: SIGINT / SIGTERM to API server 0 is forwarded (as SIGTERM) to the others, which drain as it does
(``--shutdown-timeout``); then API server 0 stops the engine. API servers 1..N-1 ignore a terminal's Ctrl-C (it
reaches the whole process group; one forwarded signal is the graceful one) and stop when API server 0 goes
away. If one of them dies, API server 0 shuts everything down.

``/metrics`` with N > 1 aggregates every process, as vLLM's: prometheus-client's multiprocess mode in a
``PROMETHEUS_MULTIPROC_DIR`` (a temporary directory unless set), counters and histograms summed over the
processes, gauges the most recently set value.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllite.server")

HEADER = "x-vllite-api-server"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def resolve_api_server_count(args: argparse.Namespace, engine_args: Any) -> int:
    """``--api-server-count`` checked against the other flags (``ValueError`` naming them); with N > 1 the engine
    is told to serve N clients."""
    from vllite.plugins.openai_server.lora import runtime_updating_allowed

    count = 1 if args.api_server_count is None else args.api_server_count
    if count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {count} (vllite has no headless mode).")
    if count == 1:
        return 1
    section = dict(engine_args.plugin_config.get("engine_proc") or {})
    if engine_args.data_parallel_size > 1:
        raise ValueError(
            f"--api-server-count {count} cannot be combined with --data-parallel-size {engine_args.data_parallel_size}:"
            " the data-parallel client runs inside one API server; use one of the two."
        )
    if section.get("tcp_host") or os.environ.get("VLLITE_ENGINE_TCP_HOST"):
        raise ValueError(f"--api-server-count {count} needs the engine's IPC sockets: unset VLLITE_ENGINE_TCP_HOST.")
    if runtime_updating_allowed():
        raise ValueError(
            f"--api-server-count {count} cannot be combined with VLLITE_ALLOW_RUNTIME_LORA_UPDATING: an adapter "
            "loaded at run time would be known to one API server only; serve adapters with --lora-modules."
        )
    section["api_server_count"] = count
    engine_args.plugin_config = {**engine_args.plugin_config, "engine_proc": section}
    return count


class ApiHeaderMiddleware:
    """Adds ``x-vllite-api-server: INDEX`` to every HTTP response (plain ASGI, so streams are untouched)."""

    def __init__(self, app: Any, index: int) -> None:
        self.app = app
        self.header = (HEADER.encode(), str(index).encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class ApiServers:
    """API server 0's view of the group: spawns the others, forwards signals, watches and stops them. With a count
    of 1 every method is a no-op, so ``vllite serve`` runs the same code either way."""

    index = 0
    banner = True

    def __init__(self, count: int, args: argparse.Namespace, sock: Any, build_app: Callable[[Any], Any]) -> None:
        self.count, self.args, self.sock, self.build_app = count, args, sock, build_app
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._metrics_dir: str | None = None
        if count > 1 and not getattr(args, "disable_log_stats", False):
            self._metrics_dir = _multiprocess_metrics()

    def start(self, engine: Any) -> None:
        """Spawns API servers 1..N-1 on ``engine`` and waits until each is ready (``EngineStartupError`` naming the
        first that failed, and why)."""
        if self.count == 1:
            return
        import multiprocessing

        from vllite.exceptions import EngineStartupError
        from vllite.plugins.engine_proc.shared_engine import AttachInfo, with_attach
        from vllite.plugins.engine_proc.spawning import main_module_hidden_from_spawn, sigint_blocked

        client = engine.engine_core
        addresses, pid = client._addresses, client.resources.proc.pid
        mp = multiprocessing.get_context("spawn")
        args = _picklable_args(self.args)
        for index in range(1, self.count):
            info = AttachInfo(index, addresses.inputs[index], addresses.outputs[index], pid)
            parent_conn, child_conn = mp.Pipe()
            config = with_attach(engine.config, info)
            payload = (args, self.sock, index, self.count, config, child_conn, self.build_app)
            proc = mp.Process(target=_child_entry, name=f"VLLiteAPIServer-{index}", args=payload, daemon=True)
            with main_module_hidden_from_spawn((args, config)), sigint_blocked():
                proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        for index, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            status = _receive(conn, proc)
            if status[0] != "ready":
                raise EngineStartupError(f"API server {index} failed to start: {status[1]}")
        logger.info("%d API servers ready (pids %s)", self.count, [os.getpid(), *(p.pid for p in self.procs)])

    def wrap(self, app: Any) -> Any:
        return app if self.count == 1 else ApiHeaderMiddleware(app, self.index)

    def started(self, server: Any) -> None:
        """Called with API server 0's uvicorn server before it serves: signals reach the others too, and the death
        of one stops the group."""
        if self.count == 1:
            return
        import asyncio

        loop = asyncio.get_running_loop()
        handle_exit = server.handle_exit

        def forward_then_exit(sig: int, frame: Any) -> None:
            self.signal_all(signal.SIGTERM)
            handle_exit(sig, frame)

        server.handle_exit = forward_then_exit  # uvicorn installs its signal handlers from this attribute
        for index, proc in enumerate(self.procs, start=1):
            loop.add_reader(proc.sentinel, self._died, index, proc, server, loop)

    def _died(self, index: int, proc: Any, server: Any, loop: Any) -> None:
        loop.remove_reader(proc.sentinel)
        if not server.should_exit:
            logger.error("API server %d (pid %d) exited unexpectedly; shutting down", index, proc.pid)
            self.signal_all(signal.SIGTERM)
            server.should_exit = True

    def signal_all(self, signum: int) -> None:
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signum)

    def stop(self) -> None:
        """Stops API servers 1..N-1 (they drain first, as API server 0 does) before the engine goes."""
        grace = float(getattr(self.args, "shutdown_timeout", 10.0)) + 10.0
        self.signal_all(signal.SIGTERM)
        for proc in self.procs:
            proc.join(timeout=grace)
            if proc.is_alive():
                logger.warning("API server %s (pid %d) did not stop in time; killing it", proc.name, proc.pid)
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def cleanup(self) -> None:
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
            os.environ.pop(MULTIPROC_ENV, None)
            self._metrics_dir = None


class _ChildRole:
    """API server ``index`` (1..N-1) as ``serve`` sees it: no banner, its header, stop when API server 0 is gone."""

    banner = False

    def __init__(self, index: int, conn: Any) -> None:
        self.index, self.conn = index, conn

    def wrap(self, app: Any) -> Any:
        return ApiHeaderMiddleware(app, self.index)

    def started(self, server: Any) -> None:
        import asyncio

        loop = asyncio.get_running_loop()

        def parent_gone() -> None:  # the pipe to API server 0 reads EOF: it exited
            loop.remove_reader(self.conn.fileno())
            server.should_exit = True

        loop.add_reader(self.conn.fileno(), parent_gone)


def _child_entry(
    args: argparse.Namespace, sock: Any, index: int, count: int, config: Any, conn: Any, build_app: Any
) -> None:
    """API server ``index``'s process: builds its settings and engine client as API server 0 did, reports ready (or
    why not), serves until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # API server 0 forwards the terminal's Ctrl-C as SIGTERM
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    from vllite.engine_args import EngineArgs
    from vllite.plugins.openai_server.context import ServerContext
    from vllite.plugins.openai_server.serving import run_event_loop, serve, server_settings, start_engine

    try:
        settings = server_settings(args, str(args.model) if args.model else "vllite-demo")
        engine, metrics = start_engine(EngineArgs.from_cli_args(args), settings, args, config=config)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    try:
        conn.send(("ready", os.getpid()))
        ctx = ServerContext(engine, settings, metrics=metrics)
        run_event_loop(serve(build_app, ctx, sock, args, _ChildRole(index, conn)))
    finally:
        engine.shutdown()
        sock.close()


def _receive(conn: Any, proc: Any) -> tuple[str, Any]:
    """The child's ready / failed message; a child that exits without one failed with its exit code."""
    from multiprocessing.connection import wait

    while not conn.poll():
        wait([conn, proc.sentinel])
        if not conn.poll() and not proc.is_alive():
            return ("failed", f"it exited with code {proc.exitcode} before reporting (see its log above)")
    try:
        return conn.recv()
    except EOFError:
        return ("failed", "it closed its pipe before reporting (see its log above)")


def _picklable_args(args: argparse.Namespace) -> argparse.Namespace:
    """The flags as a child can receive them (a command's handler function, if any, stays behind)."""
    kept = {}
    for key, value in vars(args).items():
        try:
            pickle.dumps(value)
        except Exception:
            continue
        kept[key] = value
    return argparse.Namespace(**kept)


def _multiprocess_metrics() -> str | None:
    """Turns prometheus-client's multiprocess mode on for this process and the API servers it spawns; returns the
    temporary directory made for it (None: ``PROMETHEUS_MULTIPROC_DIR`` was set, and is the user's to clean)."""
    from prometheus_client import values

    made = None
    directory = os.environ.get(MULTIPROC_ENV)
    if directory:
        logger.warning("%s=%s is set: /metrics aggregates whatever files it holds; empty it between runs.",
                       MULTIPROC_ENV, directory)  # fmt: skip
    else:
        directory = made = tempfile.mkdtemp(prefix="vllite-metrics-")
        os.environ[MULTIPROC_ENV] = directory
    values.ValueClass = values.get_value_class()  # a metric made from now on writes to the directory
    return made
