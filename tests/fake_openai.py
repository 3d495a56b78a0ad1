"""A scripted stand-in for an OpenAI-compatible server: an aiohttp.web application on an ephemeral port, served
from a background thread, so that benchmark clients (which run their own event loop) can be tested against
canned answers with known timing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web


@contextmanager
def serve_app(app: web.Application) -> Iterator[str]:
    """Serves ``app`` on 127.0.0.1 (an ephemeral port) until the block ends; yields its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> str:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    try:
        url = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def sse_write(response: web.StreamResponse, payload: str) -> None:
    """Writes one server-sent event ``data: payload``."""
    await response.write(f"data: {payload}\n\n".encode())
