"""``vllite disagg-proxy``: prefill/decode disaggregation in front of two groups of ``vllite serve`` instances.

As vLLM's disaggregated-serving proxy: each ``/v1/completions`` or ``/v1/chat/completions`` request first goes to a
prefill server (a ``kv_producer`` engine) with ``max_tokens=1``, no streaming and
``kv_transfer_params={"do_remote_decode": true}``; the ``kv_transfer_params`` in its response (where and what to
fetch) are then added to the original request, which goes to a decode server (a ``kv_consumer`` engine) and whose
answer, streamed or not, is the client's. The decode engine pulls the prompt's KV from the prefill engine instead
of computing it (see ``vllite.plugins.kv_connectors.p2p``). Each phase goes to the server of its group with the fewest
requests in flight. A prefill server that refuses the request (400, 401, ...) answers the client directly; one that
cannot be reached is a 502 naming it; a decode server that cannot load the KV recomputes it or fails the request,
per its ``kv_load_failure_policy``.

    vllite serve MODEL --port 8100 --kv-transfer-config '{"kv_connector": "p2p", "kv_role": "kv_producer"}'
    vllite serve MODEL --port 8200 --kv-transfer-config '{"kv_connector": "p2p", "kv_role": "kv_consumer"}'
    vllite disagg-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from vllite.plugins.openai_server.errors import error_response
from vllite.plugins.openai_server.http_errors import UpstreamError
from vllite.plugins.openai_server.responses import encode

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger("vllite.server")

#: Request headers passed on to the servers (the client's key is theirs to check).
_FORWARDED_HEADERS = ("authorization", "x-request-id")


@dataclass
class Upstream:
    """One ``vllite serve`` (or vLLM) server of a group, and the proxy's requests in flight to it."""

    url: str
    in_flight: int = 0


class UpstreamGroup:
    """The prefill or the decode servers; :meth:`pick` chooses the one with the fewest requests in flight."""

    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"disagg-proxy needs at least one --{role} server URL.")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--{role} {url!r} is not an http:// or https:// URL.")
        self.role = role
        self.upstreams = [Upstream(url.rstrip("/")) for url in urls]
        self._next = 0  # rotates among equally loaded servers

    def pick(self) -> Upstream:
        """The least busy server (round-robin among ties)."""
        count = len(self.upstreams)
        order = [self.upstreams[(self._next + i) % count] for i in range(count)]
        self._next = (self._next + 1) % count
        return min(order, key=lambda upstream: upstream.in_flight)


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill request: one token, not streamed, asking the engine to keep the KV for a remote decode."""
    dropped = ("stream", "stream_options", "n", "best_of", "min_tokens", "max_tokens", "max_completion_tokens")
    prefill = {k: v for k, v in body.items() if k not in dropped}
    prefill["max_completion_tokens" if chat else "max_tokens"] = 1
    prefill["stream"] = False
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return prefill


class DisaggProxy:
    """The proxy's state behind the routes: the two server groups and one HTTP client session, opened on first
    use and closed by :meth:`close` (the app's shutdown)."""

    def __init__(self, prefill: UpstreamGroup, decode: UpstreamGroup, *, timeout_s: float | None = None) -> None:
        import aiohttp  # with the app, not with this module (which the CLI imports to build its parsers)

        self.prefill = prefill
        self.decode = decode
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        #: What a request to a server that cannot be reached (or does not answer in time) raises.
        self._unreachable: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError, OSError)

    def session(self) -> aiohttp.ClientSession:
        """The client session: a whole request may take ``timeout_s``, no limit on connections."""
        import aiohttp

        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self) -> None:
        """Closes the client session, if one was opened."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def post(
        self, group: UpstreamGroup, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[Upstream, aiohttp.ClientResponse]:
        """Opens ``POST path`` on the least busy server of ``group``; the caller reads and releases the response."""
        upstream = group.pick()
        upstream.in_flight += 1
        try:
            return upstream, await self.session().post(upstream.url + path, json=body, headers=headers)
        except self._unreachable as exc:
            upstream.in_flight -= 1
            raise UpstreamError(f"the {group.role} server {upstream.url} cannot be reached: {exc}") from None

    async def relay(self, request: Request, path: str, chat: bool) -> Response:
        """Serves a completions request (``chat`` for ``/v1/chat/completions``) through both groups; a client
        that disconnects cancels it."""
        from vllite.plugins.openai_server.http_common import cancel_on_disconnect

        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return _error(400, f"The request body is not valid JSON: {exc}.")
        if not isinstance(body, dict):
            return _error(400, "The request body must be a JSON object.")
        headers = _forwarded_headers(request)
        return await cancel_on_disconnect(request, self.disaggregate(path, body, headers, chat))

    async def disaggregate(self, path: str, body: dict[str, Any], headers: dict[str, str], chat: bool) -> Response:
        """The prefill phase, then the decode phase with the prefill's ``kv_transfer_params``; the decode
        server's answer (streamed when asked and successful) is the client's."""
        try:
            upstream, first = await self.post(self.prefill, path, prefill_body(body, chat), headers)
            answer = await _read_and_release(upstream, first)
            if first.status != 200:
                return Response(answer, first.status, media_type=first.content_type)
            kv_params = json.loads(answer).get("kv_transfer_params")
            if kv_params:
                body = {**body, "kv_transfer_params": kv_params}
            upstream, second = await self.post(self.decode, path, body, headers)
        except UpstreamError as exc:
            logger.warning("disagg-proxy: %s", exc)
            return _error(502, str(exc))
        if body.get("stream") and second.status == 200:
            return StreamingResponse(_stream(upstream, second), media_type="text/event-stream")
        content = await _read_and_release(upstream, second)
        return Response(content, second.status, media_type=second.content_type)

    async def models(self, request: Request) -> Response:
        """``/v1/models`` as a decode server answers it."""
        headers = _forwarded_headers(request)
        upstream = self.decode.pick()
        try:
            async with self.session().get(upstream.url + "/v1/models", headers=headers) as response:
                return Response(await response.read(), response.status, media_type=response.content_type)
        except self._unreachable as exc:
            return _error(502, f"the decode server {upstream.url} cannot be reached: {exc}")

    async def health(self) -> Response:
        """200 when every server of both groups answers its ``/health`` with 200; else 503 naming the others."""
        down = []
        for group in (self.prefill, self.decode):
            for upstream in group.upstreams:
                try:
                    async with self.session().get(upstream.url + "/health") as response:
                        if response.status != 200:
                            down.append(upstream.url)
                except self._unreachable:
                    down.append(upstream.url)
        if down:
            return _error(503, "Unhealthy servers: " + ", ".join(down))
        return Response(status_code=200)


def _forwarded_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}


def _error(status: int, message: str, param: str | None = None) -> Response:
    return Response(encode(error_response(status, message, param)), status, media_type="application/json")


async def _read_and_release(upstream: Upstream, response: aiohttp.ClientResponse) -> bytes:
    """The whole body of a server's response; releases the connection and the server's slot whatever happens."""
    try:
        return await response.read()
    finally:
        response.release()
        upstream.in_flight -= 1


async def _stream(upstream: Upstream, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The decode server's events as they come; closing early (the client left) aborts its request."""
    try:
        async for chunk in response.content.iter_any():
            yield chunk
    finally:
        response.close()
        upstream.in_flight -= 1


def build_proxy_app(prefill: UpstreamGroup, decode: UpstreamGroup, *, timeout_s: float | None = None) -> FastAPI:
    """The FastAPI application: ``/v1/completions`` and ``/v1/chat/completions`` through both groups,
    ``/v1/models`` from a decode server, ``/health`` healthy when every server is."""
    from vllite.version import __version__

    proxy = DisaggProxy(prefill, decode, timeout_s=timeout_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.close()

    app = FastAPI(
        title="vllite disagg-proxy",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.state.proxy = proxy
    app.include_router(_proxy_router(proxy))
    return app


def _proxy_router(proxy: DisaggProxy) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.relay(request, "/v1/completions", chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.relay(request, "/v1/chat/completions", chat=True)

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(request)

    @router.get("/health")
    async def health() -> Response:
        return await proxy.health()

    return router


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    """``vllite disagg-proxy``'s flags."""
    add = parser.add_argument
    add("--prefill", nargs="+", required=True, metavar="URL", help="Prefill servers (kv_producer engines).")
    add("--decode", nargs="+", required=True, metavar="URL", help="Decode servers (kv_consumer engines).")
    add("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1).")
    add("--port", type=int, default=8000, help="Port (default 8000; 0 picks a free one and prints it).")
    add("--timeout", type=float, default=None, help="Seconds a whole upstream request may take (default: no limit).")
    add("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    add("--disable-uvicorn-access-log", action="store_true", help="Do not log one line per HTTP request.")


def run_proxy(args: argparse.Namespace) -> int:
    """Runs the proxy until SIGINT / SIGTERM; returns the exit code."""
    import uvicorn

    from vllite.plugins.openai_server.serving import bind_socket, run_event_loop

    prefill, decode = UpstreamGroup("prefill", args.prefill), UpstreamGroup("decode", args.decode)
    if args.timeout is not None and args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}.")
    app = build_proxy_app(prefill, decode, timeout_s=args.timeout)
    sock = bind_socket(args.host, args.port)
    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=5,
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"vllite: serving disaggregated prefill {' '.join(args.prefill)} / decode {' '.join(args.decode)} "
        f"on http://{shown}:{port} (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    try:
        run_event_loop(uvicorn.Server(config).serve(sockets=[sock]))
    finally:
        sock.close()
    return 0
