"""Registers the Ray data-parallel clients ``dp_ray`` (``LLM``) and ``async_dp_ray`` (``AsyncLLM``, ``vllite serve``),
only where Ray is installed; nothing is imported until a client is built."""

from __future__ import annotations

import importlib.util

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_engine_clients(register: Register) -> None:
    if importlib.util.find_spec("ray") is None:
        return  # `pip install ray` enables the backend
    register("dp_ray", "vllite.plugins.ray_dp.client:SyncRayDPClient")
    register("async_dp_ray", "vllite.plugins.ray_dp.client:AsyncRayDPClient")
