"""Linear layers that keep their weight packed and multiply with torch's fused CPU weight-only kernels.

- :class:`Int8WeightLinear`: ``torch.ops.aten._weight_int8pack_mm`` (int8 weight ``[out, in]``, one scale per output
  channel). A group-wise int8 weight is split into its column groups, one call each, summed.
- :class:`Int4WeightLinear`: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the weight packed once by
  ``_convert_weight_to_int4pack_for_cpu``; the kernel computes ``(q - 8) * scale + zero`` per group of 32, 64, 128
  or 256 input columns, so a larger group (or one scale per channel) repeats its scale over kernel groups.

Scales are kept in the activation dtype (the kernels require it); accumulation is in float32 inside the kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from vllite.exceptions import ModelLoadError
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
    """``y = x @ (q * scale).T + bias`` with ``q`` int8, through ``_weight_int8pack_mm`` per column group."""

    qweight: torch.Tensor  # int8 [groups, out, group_size]
    scales: torch.Tensor  # [groups, out], activation dtype

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(qw, bias, dtype)
        if qw.bits != 8 or qw.zeros is not None:
            raise ModelLoadError("Int8WeightLinear takes symmetric 8-bit weights")
        out_f, in_f = qw.shape
        groups = qw.scales.shape[1]
        padded = groups * qw.group_size
        q = torch.nn.functional.pad(qw.q, (0, padded - in_f)) if padded != in_f else qw.q
        # [groups, out, group_size]: each group is a contiguous int8 matrix the kernel takes as is.
        self.register_buffer("qweight", q.reshape(out_f, groups, qw.group_size).transpose(0, 1).contiguous())
        self.register_buffer("scales", qw.scales.t().to(dtype).contiguous())  # [groups, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The packed matmul (activations in the scales' dtype)."""
        x2 = self._prepare(x.to(self.scales.dtype))
        groups, _, size = self.qweight.shape
        if groups == 1:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight[0], self.scales[0])
        else:
            padded = groups * size
            if padded != self.in_features:
                x2 = torch.nn.functional.pad(x2, (0, padded - self.in_features))
            y = torch.ops.aten._weight_int8pack_mm(x2[:, :size].contiguous(), self.qweight[0], self.scales[0])
            for g in range(1, groups):
                part = x2[:, g * size : (g + 1) * size].contiguous()
                y = y + torch.ops.aten._weight_int8pack_mm(part, self.qweight[g], self.scales[g])
        return self._finish(y, x)


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
