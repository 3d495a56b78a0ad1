"""Linear layers that keep their weight packed and multiply with fused CPU weight-only kernels.

- :class:`Int8WeightLinear`: int8 weight ``[out, in]`` with one scale per output channel and column group, through
  :mod:`vllite.kernels.cpu_int8_linear` at decode batch sizes (torch's ``_weight_int8pack_mm`` is slower than a
  float32 matmul on AVX2 CPUs), dequantized into torch's matmul for prefill.
- :class:`Int4WeightLinear`: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the weight packed once by
  ``_convert_weight_to_int4pack_for_cpu``; the kernel computes ``(q - 8) * scale + zero`` per group of 32, 64, 128
  or 256 input columns, so a larger group (or one scale per channel) repeats its scale over kernel groups.

The int4 layer keeps its scales in the activation dtype (torch's kernel requires it), the int8 layer in float32;
accumulation is in float32 inside the kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from vllite.exceptions import ModelLoadError
from vllite.kernels import cpu_int8_linear
from vllite.kernels.cpu_int8_linear import GROUP_MULTIPLE
from vllite.plugins.transformers_executor.quantization.formats import QuantizedWeight

_INT4_KERNEL_GROUPS = (256, 128, 64, 32)


class _PackedLinear(nn.Module):
    """What both packed layers share: the shape attributes of ``nn.Linear``, the bias and the input permutation."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.group_size = qw.group_size
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.perm: torch.Tensor | None
        self.register_buffer("perm", qw.perm)

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        return x2.contiguous()

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int8WeightLinear(_PackedLinear):
    """``y = x @ (q * scale).T + bias`` with ``q`` int8: vllite's compiled kernel at decode batch sizes; else torch's
    ``_weight_int8pack_mm`` (one scale per channel, no compiled kernel) or, for prefill and group-wise scales without
    the kernel, the weight dequantized for torch's matmul."""

    qweight: torch.Tensor  # int8 [out, groups * kernel_group], columns zero-padded
    scales: torch.Tensor  # float32 [out, groups]

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(qw, bias, dtype)
        if qw.bits != 8 or qw.zeros is not None:
            raise ModelLoadError("Int8WeightLinear takes symmetric 8-bit weights")
        in_f = qw.shape[1]
        groups = qw.scales.shape[1]
        # One scale per channel is one group: padded with zero columns to the kernel's multiple of 32.
        self.kernel_group = qw.group_size if groups > 1 else -(-in_f // GROUP_MULTIPLE) * GROUP_MULTIPLE
        padded = groups * self.kernel_group
        q = torch.nn.functional.pad(qw.q, (0, padded - in_f)) if padded != in_f else qw.q
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", qw.scales.to(torch.float32).contiguous())
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 matmul; the result in the activation dtype."""
        x2 = self._prepare(x.to(self.dtype))
        padded = self.qweight.shape[1]
        if padded != self.in_features:
            x2 = torch.nn.functional.pad(x2, (0, padded - self.in_features))
        y = cpu_int8_linear.int8_linear(x2, self.qweight, self.scales, self.kernel_group)
        if y is None:
            y = self._torch_matmul(x2)
        return self._finish(y.to(self.dtype), x)

    def _torch_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        out_f, groups = self.scales.shape
        if groups == 1 and x2.shape[0] <= cpu_int8_linear.MAX_ROWS:
            return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales[:, 0].to(x2.dtype))
        weight = self.qweight.view(out_f, groups, self.kernel_group).to(torch.float32) * self.scales.unsqueeze(-1)
        return torch.nn.functional.linear(x2, weight.view(out_f, -1).to(x2.dtype))


class Int4WeightLinear(_PackedLinear):
    """``y = x @ ((q - 8) * scale + zero).T + bias`` with ``q`` 0..15, through ``_weight_int4pack_mm_for_cpu``."""

    qweight: torch.Tensor  # uint8, the kernel's packed layout
    scales_and_zeros: torch.Tensor  # [in / kernel_group, out, 2], activation dtype

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(qw, bias, dtype)
        if qw.bits != 4:
            raise ModelLoadError("Int4WeightLinear takes 4-bit weights")
        in_f = qw.shape[1]
        kernel_group = next((g for g in _INT4_KERNEL_GROUPS if qw.group_size % g == 0 and in_f % g == 0), None)
        if kernel_group is None:
            raise ModelLoadError(
                f"a 4-bit layer of {in_f} input columns in groups of {qw.group_size} cannot run on the CPU int4 "
                "kernel: the group size and the input width must be multiples of 32"
            )
        self.kernel_group = kernel_group
        # Kernel group j covers columns [j*kg, (j+1)*kg), all inside checkpoint group (j*kg) // group_size.
        index = torch.arange(in_f // kernel_group) * kernel_group // qw.group_size
        scales = qw.scales[:, index]
        zeros = torch.zeros_like(scales) if qw.zeros is None else qw.zeros[:, index]
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous())
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32).contiguous(), 1)
        self.register_buffer("qweight", packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The packed matmul (activations in the scales' dtype)."""
        x2 = self._prepare(x.to(self.scales_and_zeros.dtype))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.kernel_group, self.scales_and_zeros)
        return self._finish(y, x)


def packed_linear(qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> _PackedLinear:
    """The packed layer for ``qw``'s bit width."""
    return Int8WeightLinear(qw, bias, dtype) if qw.bits == 8 else Int4WeightLinear(qw, bias, dtype)
