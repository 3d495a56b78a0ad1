"""A model's float linear layers at decode batch sizes through vllite's compiled CPU kernel.

At one to a few rows a linear layer's time is the time to read its weight, and torch's CPU linear reads it at about a
third of the memory's speed there (on this AMD EPYC with AVX-512 and AVX512-BF16, one row: 11 of 33 GB/s in float32,
13 GB/s through oneDNN's native bfloat16; a decode step of a ~30M Llama spent 10 of its 14 ms in it).
:class:`DecodeLinear` is an ``nn.Linear`` (same parameters, same state dict, still an ``nn.Linear`` to everything
that inspects the model) whose forward sends inputs of up to ``max_rows`` rows to
:func:`vllite.kernels.cpu_linear.dense_linear` and everything else (prefill) to torch. :func:`use_decode_linears`
turns a loaded CPU model's float linears into it.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import nn

from vllite.kernels import cpu_linear

logger = logging.getLogger(__name__)

__all__ = ["DecodeLinear", "use_decode_linears"]

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


def use_decode_linears(model: nn.Module) -> int:
    """Turns ``model``'s float32 and bfloat16 ``nn.Linear`` layers (input width a multiple of 32, weight contiguous)
    into :class:`DecodeLinear` in place and returns how many; none where the kernel is unavailable."""
    if cpu_linear.linear_kernel() is None:
        return 0
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.in_features % cpu_linear.GROUP_MULTIPLE:
            continue
        weight = module.weight
        if not weight.is_contiguous() or weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        module.__class__ = DecodeLinear
        if weight.dtype == torch.bfloat16:
            cast(DecodeLinear, module).max_rows = BF16_MAX_ROWS
        count += 1
    logger.debug("%d linear layers multiply decode batches in the compiled CPU kernel", count)
    return count
