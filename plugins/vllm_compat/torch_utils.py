"""``async_tensor_h2d``: a host-to-device copy that does not block the host, as vLLM plugins call it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def async_tensor_h2d(
    data: Any,
    device: torch.device | str | torch.dtype | None = None,
    dtype: torch.dtype | torch.device | str | None = None,
    out: torch.Tensor | None = None,
    pin_memory: bool | None = None,
) -> torch.Tensor:
    """Copies ``data`` (a list, numpy array or host tensor) to ``device``, or into ``out``, without blocking.

    vLLM's current signature is ``(data, device=None, dtype=None, out=None)``; releases before it took
    ``(data, dtype, target_device, pin_memory)``, and a call in that order (a dtype second) works too. The host
    copy is pinned when CUDA is available and the target is a CUDA device (``pin_memory=False`` turns that off),
    which is what makes the copy asynchronous.
    """
    import numpy as np
    import torch

    if isinstance(device, torch.dtype):  # the older (data, dtype, target_device, pin_memory) order
        device, dtype = dtype, device
        if isinstance(out, bool):  # the fourth argument was pin_memory
            out, pin_memory = None, out
    if isinstance(dtype, (str, torch.device)) or isinstance(device, torch.dtype):
        raise TypeError(f"async_tensor_h2d: got device={device!r}, dtype={dtype!r}; expected a device and a dtype")
    if dtype is None and out is not None:
        dtype = out.dtype
    target = out.device if out is not None else (torch.device(device) if device is not None else None)
    if target is None:
        raise ValueError("async_tensor_h2d needs a device or an out tensor.")
    if isinstance(data, np.ndarray):
        host = torch.from_numpy(data)
    elif isinstance(data, torch.Tensor):
        host = data
    else:
        host = torch.tensor(data, dtype=dtype, device="cpu")
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    pin = pin_memory is not False and target.type == "cuda" and torch.cuda.is_available()
    if pin and host.device.type == "cpu" and not host.is_pinned():
        host = host.pin_memory()
    if out is not None:
        return out.copy_(host, non_blocking=True)
    return host.to(device=target, non_blocking=True)
