"""Registers the multiprocess engine clients: ``mp`` (``SyncMPClient``) and ``async_mp`` (``AsyncMPClient``), and
the data-parallel ones on local processes, ``dp_mp`` / ``async_dp_mp`` (``SyncDPClient`` / ``AsyncDPClient``).

The classes are registered by class path, so loading this plugin imports neither zmq nor torch.
"""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_engine_clients(register: Register) -> None:
    register("mp", "vllite.plugins.engine_proc.client:SyncMPClient")
    register("async_mp", "vllite.plugins.engine_proc.async_client:AsyncMPClient")
    register("dp_mp", "vllite.plugins.engine_proc.dp_client:SyncDPClient")
    register("async_dp_mp", "vllite.plugins.engine_proc.dp_client:AsyncDPClient")
