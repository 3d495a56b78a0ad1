"""Device detection without importing torch at ``import vllite`` time."""

from __future__ import annotations

import functools


@functools.cache
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
