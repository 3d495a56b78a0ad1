"""A compiled CPU kernel for weight-only int8 linear layers at decode batch sizes.

Decoding a few sequences reads every weight once per step and does little else with it, so a layer's time is the
time to read its weights. torch's own int8 weight-only kernel (``_weight_int8pack_mm``) is fast where the CPU has
AVX-512 but, on an AVX2 CPU, slower than the float32 matmul it should beat (measured here on a ~100M Llama: 0.49x
float32's decode speed at batch 1, 0.11x at batch 8). This kernel (``cpu_int8_linear.cpp``) reads each int8 weight
once, widens it in registers against up to four activation rows, and scales each group's partial sum once.

:func:`int8_linear` serves up to :data:`MAX_ROWS` activation rows (a decode step's batch); larger batches (prefill)
are compute-bound, and the caller dequantizes and runs torch's matmul instead. Built like the decode-attention kernel
(:mod:`vllite.kernels.cpp_build`); ``None`` from :func:`int8_linear_kernel` when it cannot be built or
``VLLITE_CPU_INT8_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import functools
import os
import pathlib
from typing import Any

import torch

from vllite.kernels.cpp_build import load_cpp_module, module_name

__all__ = ["GROUP_MULTIPLE", "MAX_ROWS", "int8_linear", "int8_linear_kernel"]

#: The most activation rows one call takes: beyond a decode batch the matmul is compute-bound, not read-bound.
MAX_ROWS = 16
#: The kernel's group size must be a multiple of this (its inner loop widens 32 weights per step).
GROUP_MULTIPLE = 32

_SOURCE = (pathlib.Path(__file__).parent / "cpu_int8_linear.cpp").read_text()
_CPP_DECL = (
    "void int8_linear(torch::Tensor y, torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size);"
)
_NAME = module_name("vllite_cpu_int8_linear_", _SOURCE)


@functools.cache
def int8_linear_kernel() -> Any | None:
    """The compiled module (built on first use, then loaded from torch's extension cache), or ``None``."""
    if os.environ.get("VLLITE_CPU_INT8_KERNEL", "1") == "0":
        return None
    return load_cpp_module(_NAME, _CPP_DECL, _SOURCE, ["int8_linear"], "the CPU int8 linear kernel")


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """``x [M, K] @ (q * scale).T`` in float32 (``q`` int8 ``[N, K]``, ``scales`` float32 ``[N, K / group_size]``),
    or ``None`` where the kernel does not apply: no kernel, more than :data:`MAX_ROWS` rows, or a group size that is
    not a multiple of :data:`GROUP_MULTIPLE`."""
    if x.shape[0] > MAX_ROWS or group_size % GROUP_MULTIPLE:
        return None
    kernel = int8_linear_kernel()
    if kernel is None:
        return None
    y = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    kernel.int8_linear(y, x.to(torch.float32).contiguous(), q, scales, group_size)
    return y
