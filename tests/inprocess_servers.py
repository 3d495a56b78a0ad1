"""Several ``vllite serve`` applications in front of one engine, in this process: each with its own server settings
(chat template, tool and reasoning parsers) on its own loopback port, so a test drives many server configurations
with the official ``openai`` client while paying for one engine start.

The engine and every uvicorn server run on one event loop in a background thread; ``urls[name]`` is a server's
``base_url``; ``contexts[name]`` its :class:`ServerContext`. ``close()`` stops the servers and the engine.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

START_TIMEOUT_S = 300.0


class InProcessServers:
    """One ``AsyncLLM`` (from ``engine_args``) served by one app per entry of ``settings``."""

    def __init__(self, engine_args: Any, settings: dict[str, Any], *, metrics: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inprocess-servers", daemon=True)
        self.thread.start()
        self.engine: Any = None
        self.servers: list[Any] = []
        self.tasks: list[asyncio.Future] = []
        self.contexts: dict[str, Any] = {}
        self.urls: dict[str, str] = {}
        try:
            starting = self._start(engine_args, settings, metrics)
            asyncio.run_coroutine_threadsafe(starting, self.loop).result(START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    async def _start(self, engine_args: Any, settings: dict[str, Any], metrics: bool) -> None:
        import uvicorn

        from vllite.plugins.engine_proc.async_llm import AsyncLLM
        from vllite.plugins.openai_server.app import build_app
        from vllite.plugins.openai_server.cli import bind_socket
        from vllite.plugins.openai_server.context import ServerContext

        loggers: list[Any] = []
        if metrics:  # one Prometheus logger (what `vllite serve` gives its first served name), on every app's /metrics
            from vllite.plugins.openai_server.observability.metrics import PrometheusStatLogger

            first = next(iter(settings.values())).served_model_names[0]
            loggers.append(lambda info: PrometheusStatLogger(first, info))
        self.engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=loggers or None)
        logger = self.engine.stat_loggers[0] if metrics else None
        for name, server_settings in settings.items():
            ctx = ServerContext(self.engine, server_settings, metrics=logger)
            sock = bind_socket("127.0.0.1", 0)
            config = uvicorn.Config(build_app(ctx), log_level="warning", access_log=False, lifespan="off")
            server = uvicorn.Server(config)
            self.servers.append(server)
            self.tasks.append(asyncio.ensure_future(server.serve(sockets=[sock])))
            self.contexts[name] = ctx
            self.urls[name] = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        while not all(server.started for server in self.servers):
            await asyncio.sleep(0.02)

    def call(self, coroutine: Any, timeout_s: float = 60.0) -> Any:
        """Runs ``coroutine`` on the servers' loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        """Stops the servers, then the engine and the loop."""
        for server in self.servers:
            server.should_exit = True
        if self.tasks:

            async def _wait() -> None:
                await asyncio.wait(self.tasks, timeout=30)

            asyncio.run_coroutine_threadsafe(_wait(), self.loop).result(60)
        if self.engine is not None:
            self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
