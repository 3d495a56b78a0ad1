"""``GET /kv_event_sources``: where a KV-aware router subscribes to this server's KV-cache events (vLLM's route).

The answer is a bare JSON array with one entry per data-parallel engine: ``data_parallel_rank``, ``endpoint`` (the
PUB socket, with a wildcard host replaced by this machine's address, and engine ``r``'s TCP port offset by ``r``),
``replay_endpoint`` and ``topic``; ``[]`` when KV-cache events are off (``--kv-events-config``). Like vLLM's, the
route needs no dev-mode switch.
"""

from __future__ import annotations

import socket
from typing import Any

from fastapi import APIRouter

from vllite.kv_events import KVEventsConfig, endpoint_for_rank


def kv_event_sources(config: KVEventsConfig | None, data_parallel_size: int = 1) -> list[dict[str, Any]]:
    """The discovery list for ``config`` (``[]`` when events are off)."""
    if config is None or not config.enabled:
        return []
    host = _advertised_host()
    sources = []
    for rank in range(data_parallel_size):
        replay = config.replay_endpoint
        sources.append(
            {
                "data_parallel_rank": rank,
                "endpoint": _advertise(endpoint_for_rank(config.endpoint, rank), host),
                "replay_endpoint": _advertise(endpoint_for_rank(replay, rank), host) if replay else None,
                "topic": config.topic,
            }
        )
    return sources


def kv_events_router(ctx: Any) -> APIRouter:
    """The ``/kv_event_sources`` route over the server's engine config."""
    router = APIRouter()

    @router.get("/kv_event_sources")
    async def get_kv_event_sources() -> list[dict[str, Any]]:
        config = ctx.engine.config
        return kv_event_sources(config.kv_events_config, config.parallel_config.data_parallel_size)

    return router


def _advertise(endpoint: str, host: str) -> str:
    """``endpoint`` with a bind-all host (``*``, ``0.0.0.0``, ``::``) replaced by ``host``."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:" + endpoint[len(wildcard) :]
    return endpoint


def _advertised_host() -> str:
    """This machine's address as other hosts reach it (the one its default route uses), else loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
