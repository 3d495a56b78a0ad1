"""A model's float linear layers on the CPU: decode batch sizes through vllite's compiled kernel, or, in bfloat16 on a
CPU whose oneDNN has bfloat16 kernels (AVX512-BF16 or AMX), every batch through a weight oneDNN reordered once.

At one to a few rows a linear layer's time is the time to read its weight, and torch's CPU linear reads it at about a
third of the memory's speed there (on this AMD EPYC with AVX-512 and AVX512-BF16, one row: 11 of 33 GB/s in float32,
13 GB/s through oneDNN's native bfloat16; a decode step of a ~30M Llama spent 10 of its 14 ms in it).
:class:`DecodeLinear` is an ``nn.Linear`` (same parameters, same state dict, still an ``nn.Linear`` to everything
that inspects the model) whose forward sends inputs of up to ``max_rows`` rows to
:func:`vllite.kernels.cpu_linear.dense_linear` and everything else (prefill) to torch. :func:`use_decode_linears`
turns a loaded CPU model's float linears into it.

In bfloat16 on a CPU where oneDNN has native bfloat16 kernels, :class:`PackedLinear` takes their place: the weight
is reordered once at load into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, as vLLM's CPU
build does for its AMX kernels) and every call runs ``torch.ops.mkldnn._linear_pointwise`` on it, the same results
as ``F.linear``. Measured on that EPYC at the Qwen2.5-0.5B MLP's shape (896 -> 4,864): 3.2x ``F.linear`` at one row
(99 vs 320 us) and 1.3x the compiled row kernel, 1.8x at 16 rows, 1.4x at 32, 1.1x at 256. The plain weight stays
(the state dict, LoRA and the compiled decode step read it), so a bfloat16 model's linear weights take twice their
memory. ``VLLITE_CPU_PACKED_LINEAR=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
from typing import cast

import torch
from torch import nn

from vllite.kernels import cpu_linear

logger = logging.getLogger(__name__)

__all__ = ["DecodeLinear", "PackedLinear", "onednn_bf16_linear_available", "use_decode_linears"]

#: bfloat16 rows up to which the kernel beats torch's bfloat16 linear (measured on a ~30M Llama's layers, on a CPU with
#: AVX512-BF16: 2.2x at one row, 1.1x at four, even at eight, slower at sixteen).
BF16_MAX_ROWS = 4


class DecodeLinear(nn.Linear):
    """An ``nn.Linear`` whose forward multiplies decode-sized inputs (``max_rows`` rows at most) in the compiled
    kernel, float32 accumulation, the result in the input's dtype."""

    max_rows: int = cpu_linear.MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if 0 < rows <= self.max_rows:
            y = cpu_linear.dense_linear(x.reshape(rows, self.in_features), self.weight)
            if y is not None:
                if self.bias is not None:
                    y += self.bias
                return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return nn.functional.linear(x, self.weight, self.bias)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose bfloat16 weight is also kept in oneDNN's blocked layout (``packed_weight``, reordered
    once), through which every bfloat16 input is multiplied; anything else takes ``F.linear``."""

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight, self.bias)


def onednn_bf16_linear_available() -> bool:
    """Whether torch's oneDNN has native bfloat16 linear kernels here (and ``VLLITE_CPU_PACKED_LINEAR`` allows)."""
    if os.environ.get("VLLITE_CPU_PACKED_LINEAR", "1").strip() in ("0", "false", "False"):
        return False
    mkldnn = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_reorder_linear_weight"):
        return False
    return bool(mkldnn._is_mkldnn_bf16_supported())


def _pack(module: nn.Linear) -> None:
    module.__class__ = PackedLinear
    cast(PackedLinear, module).packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)


def use_decode_linears(model: nn.Module) -> int:
    """Turns ``model``'s float32 and bfloat16 ``nn.Linear`` layers (weight contiguous) into :class:`PackedLinear`
    (bfloat16, where oneDNN has bfloat16 kernels) or :class:`DecodeLinear` (input width a multiple of 32, where the
    compiled kernel is available) in place, and returns how many."""
    packed = onednn_bf16_linear_available()
    kernel = cpu_linear.linear_kernel() is not None
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or not module.weight.is_contiguous():
            continue
        weight = module.weight
        if weight.dtype == torch.bfloat16 and packed:
            _pack(module)
            count += 1
            continue
        if not kernel or module.in_features % cpu_linear.GROUP_MULTIPLE:
            continue
        if weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        module.__class__ = DecodeLinear
        if weight.dtype == torch.bfloat16:
            cast(DecodeLinear, module).max_rows = BF16_MAX_ROWS
        count += 1
    logger.debug("%d linear layers through oneDNN's packed bfloat16 weights or the compiled CPU kernel", count)
    return count
