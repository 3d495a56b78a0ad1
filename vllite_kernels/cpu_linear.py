"""Compiled CPU kernels for linear layers at decode batch sizes: float32 or bfloat16 weights, and weight-only int8
and int4 ones.

Decoding a few sequences reads every weight once per step and does little else with it, so a layer's time is the
time to read its weights. torch's CPU kernels do not read at the memory's speed there: its float32 linear at one row
reads about 11 GB/s on an AVX-512 AMD EPYC that streams 33 GB/s; its weight-only kernels (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``) are slower still than the float32 matmul they should beat (on a ~100M Llama: W8A16 at
0.49x float32's decode speed at batch 1 and 0.11x at batch 8, W4A16 at 0.40x and 0.13x). These kernels
(``cpu_linear.cpp``) read each weight once, widen it in registers against up to four activation rows, and, for
codes, scale each group's partial sum once (an int4 group also adds its offset times the group's activation sum).

:func:`dense_linear`, :func:`int8_linear` and :func:`int4_linear` serve up to :data:`MAX_ROWS` activation rows (a
decode step's batch); larger batches (prefill) are compute-bound, and the caller uses torch's matmul instead. Int4
codes are packed by :func:`pack_int4` in the kernel's layout (byte ``j`` of each 16-column chunk: column ``j`` in the
low nibble, column ``j + 8`` in the high one). Built like the decode-attention kernel
(:mod:`vllite.kernels.cpp_build`); :func:`linear_kernel` is ``None`` when it cannot be built or
``VLLITE_CPU_LINEAR_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vllite.kernels.cpp_build import load_cpp_module

__all__ = [
    "GROUP_MULTIPLE",
    "MAX_ROWS",
    "dense_linear",
    "int4_linear",
    "int8_linear",
    "pack_int4",
    "unpack_int4",
    "linear_kernel",
]

#: The most activation rows one call takes: beyond a decode batch the matmul is compute-bound, not read-bound.
MAX_ROWS = 16
#: The group size must be a multiple of this (the inner loops widen 32 codes per step).
GROUP_MULTIPLE = 32

_CPP_DECL = (
    "void int8_linear(torch::Tensor y, torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size);\n"
    "void int4_linear(torch::Tensor y, torch::Tensor x, torch::Tensor codes, torch::Tensor scales, "
    "torch::Tensor offsets, int64_t group_size);\n"
    "void dense_linear(torch::Tensor y, torch::Tensor x, torch::Tensor w);"
)


@functools.cache
def linear_kernel() -> Any | None:
    """The compiled module (built on first use, then loaded from torch's extension cache), or ``None``."""
    return load_cpp_module(
        "cpu_linear.cpp",
        _CPP_DECL,
        ["int8_linear", "int4_linear", "dense_linear"],
        "the CPU linear kernels",
        switch="VLLITE_CPU_LINEAR_KERNEL",
    )


def _kernel_for(x: torch.Tensor, group_size: int) -> Any | None:
    if x.shape[0] > MAX_ROWS or group_size % GROUP_MULTIPLE:
        return None
    return linear_kernel()


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """``x [M, K] @ (q * scale).T`` in float32 (``q`` int8 ``[N, K]``, ``scales`` float32 ``[N, K / group_size]``),
    or ``None`` where the kernel does not apply: no kernel, more than :data:`MAX_ROWS` rows, or a group size that is
    not a multiple of :data:`GROUP_MULTIPLE`."""
    kernel = _kernel_for(x, group_size)
    if kernel is None:
        return None
    y = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    kernel.int8_linear(y, x.to(torch.float32).contiguous(), q, scales, group_size)
    return y


def int4_linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> torch.Tensor | None:
    """``x [M, K] @ (c * scale + offset).T`` in float32 for the codes ``c`` packed by :func:`pack_int4` (``codes``
    uint8 ``[N, K / 2]``; ``scales`` and ``offsets`` float32 ``[N, K / group_size]``), or ``None`` where the kernel
    does not apply (as for :func:`int8_linear`)."""
    kernel = _kernel_for(x, group_size)
    if kernel is None:
        return None
    y = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    kernel.int4_linear(y, x.to(torch.float32).contiguous(), codes, scales, offsets, group_size)
    return y


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 ``[N, K]`` (``K`` a multiple of 16) packed two per byte in the kernel's layout: ``[N, K / 2]``."""
    n, k = codes.shape
    chunks = codes.to(torch.uint8).view(n, k // 16, 2, 8)  # [.., low half / high half, 8 columns]
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 codes ``[N, K]``."""
    n, half = packed.shape
    chunks = packed.view(n, half // 8, 1, 8)
    return torch.cat([chunks & 0xF, chunks >> 4], dim=2).reshape(n, half * 2)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x [M, K] @ weight.T`` in float32 for a float32 or bfloat16 ``weight [N, K]``, or ``None`` where the kernel does
    not apply: no kernel, more than :data:`MAX_ROWS` rows, ``K`` not a multiple of :data:`GROUP_MULTIPLE`, another
    weight dtype or a non-contiguous weight."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous():
        return None
    kernel = _kernel_for(x, x.shape[-1])
    if kernel is None:
        return None
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    kernel.dense_linear(y, x.to(torch.float32).contiguous(), weight)
    return y
