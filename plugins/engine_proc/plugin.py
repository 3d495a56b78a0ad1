"""Registers the multiprocess engine clients: ``mp`` (``SyncMPClient``) and ``async_mp`` (``AsyncMPClient``), and
the data-parallel ones on local processes, ``dp_mp`` / ``async_dp_mp`` (``SyncDPClient`` / ``AsyncDPClient``).

The classes are imported lazily, so loading this plugin imports neither zmq nor torch.
"""

from __future__ import annotations

from typing import Any

from vllite.hookspecs import hookimpl


class _LazyClient:
    """A registry entry that imports the client class on first construction (keeps ``import vllite`` light)."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    def resolve(self) -> type:
        import importlib

        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    # The plugin manager checks that engine clients have these attributes.
    add_request = get_output = shutdown = None

    def __repr__(self) -> str:
        return f"<engine client {self.module}:{self.name}>"


@hookimpl
def vllite_register_engine_clients(register: Any) -> None:
    register("mp", _LazyClient("vllite.plugins.engine_proc.client", "SyncMPClient"))
    register("async_mp", _LazyClient("vllite.plugins.engine_proc.async_client", "AsyncMPClient"))
    register("dp_mp", _LazyClient("vllite.plugins.engine_proc.dp_client", "SyncDPClient"))
    register("async_dp_mp", _LazyClient("vllite.plugins.engine_proc.dp_client", "AsyncDPClient"))
