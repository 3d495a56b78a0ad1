"""Registers the default executor under ``default``, ``cpu`` and ``cuda``.

The executor classes import torch, so they are registered by class path: imported when an engine selects one,
never when the plugin manager merely lists the registry.
"""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_executors(register: Register) -> None:
    """``default`` follows ``--device`` (auto: CUDA when available); ``cpu`` and ``cuda`` force a device."""
    register("default", "vllite.plugins.transformers_executor.executor:DefaultExecutor")
    register("cpu", "vllite.plugins.transformers_executor.executor:CPUExecutor")
    register("cuda", "vllite.plugins.transformers_executor.executor:CUDAExecutor")
