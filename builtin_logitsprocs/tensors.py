"""Small tensor helpers shared by the builtin processors."""

from __future__ import annotations

import torch


def use_pinned_memory(is_pin_memory: bool) -> bool:
    """Pinned host memory only when asked for and CUDA exists (pinning fails without a CUDA runtime)."""
    return bool(is_pin_memory) and torch.cuda.is_available()


def device_tensor(data: list, dtype: torch.dtype, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """Builds ``data`` on the host (pinned if asked) and copies it to ``device`` without blocking."""
    host = torch.tensor(data, dtype=dtype, device="cpu", pin_memory=use_pinned_memory(pin_memory))
    return host.to(device=device, non_blocking=True)
