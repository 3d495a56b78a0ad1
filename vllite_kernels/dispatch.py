"""Which kernel takes a tensor: Triton for CUDA tensors (when triton is usable), the CPU fast path for CPU tensors
(unless ``VLLITE_CPU_ATTENTION=reference``), the torch reference otherwise. Imports neither torch nor triton."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


@functools.cache
def is_triton_available() -> bool:
    """True when triton is installed, CUDA is available to torch, and ``VLLITE_DISABLE_TRITON`` is unset.

    Cached after the first call; does not import triton.
    """
    if os.environ.get("VLLITE_DISABLE_TRITON", "") not in ("", "0"):
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    return torch.cuda.is_available()


def use_triton(tensor: Tensor) -> bool:
    """Whether the dispatchers below send work on ``tensor`` to the Triton kernels (CUDA tensor + triton)."""
    return tensor.is_cuda and is_triton_available()


@functools.cache
def _cpu_reference_selected() -> bool:
    return os.environ.get("VLLITE_CPU_ATTENTION", "").strip().lower() in ("reference", "ref")


def use_cpu_fast_path(tensor: Tensor) -> bool:
    """Whether work on ``tensor`` goes to :mod:`vllite.kernels.cpu_attention` (a CPU tensor, unless
    ``VLLITE_CPU_ATTENTION=reference``, read once per process)."""
    return tensor.device.type == "cpu" and not _cpu_reference_selected()
