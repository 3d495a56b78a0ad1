"""Registers the default executor under ``default``, ``cpu`` and ``cuda``.

The executor classes import torch, so they are imported only when the ``executors`` registry is built (engine
start-up), never when the plugin manager merely loads this module.
"""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_executors(register: Register) -> None:
    """``default`` follows ``--device`` (auto: CUDA when available); ``cpu`` and ``cuda`` force a device."""
    from vllite.plugins.transformers_executor.executor import CPUExecutor, CUDAExecutor, DefaultExecutor

    register("default", DefaultExecutor)
    register("cpu", CPUExecutor)
    register("cuda", CUDAExecutor)
