"""The platform layer: device detection without importing torch at ``import vllite`` time, and where the engine's
CPU threads run (:mod:`vllite.platform.cpu_threads`, read by the frontend, the engine process and the executor)."""

from __future__ import annotations

import functools


@functools.cache
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
