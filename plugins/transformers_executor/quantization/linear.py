"""Linear layers that keep their weight packed and multiply with fused CPU weight-only kernels.

- :class:`Int8WeightLinear`: int8 weight ``[out, in]`` with one scale per output channel and column group, through
  :mod:`vllite.kernels.cpu_linear` at decode batch sizes (torch's ``_weight_int8pack_mm`` is slower than a
  float32 matmul on the AVX-512 AMD EPYC measured), dequantized into torch's matmul for prefill.
- :class:`Int4WeightLinear`: codes 0..15 packed two per byte, ``(q - 8) * scale + zero`` per group of input columns
  (a multiple of 32, or one scale per channel), through the same module's int4 kernel at decode batch sizes,
  unpacked and dequantized into torch's matmul for prefill.

Scales are float32, and so is accumulation inside the kernels; activations and results are in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from vllite.exceptions import ModelLoadError
from vllite.kernels import cpu_linear
from vllite.kernels.cpu_linear import GROUP_MULTIPLE
from vllite.plugins.transformers_executor.quantization.formats import QuantizedWeight


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
        y = cpu_linear.int8_linear(x2, self.qweight, self.scales, self.kernel_group)
        if y is None:
            y = self._torch_matmul(x2)
        return self._finish(y.to(self.dtype), x)

    def _torch_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        out_f, groups = self.scales.shape
        if groups == 1 and x2.shape[0] <= cpu_linear.MAX_ROWS:
            return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales[:, 0].to(x2.dtype))
        weight = self.qweight.view(out_f, groups, self.kernel_group).to(torch.float32) * self.scales.unsqueeze(-1)
        return torch.nn.functional.linear(x2, weight.view(out_f, -1).to(x2.dtype))


class Int4WeightLinear(_PackedLinear):
    """``y = x @ ((q - 8) * scale + zero).T + bias`` with ``q`` 0..15 packed two per byte: vllite's compiled kernel at
    decode batch sizes, else the weight unpacked and dequantized for torch's matmul."""

    qweight: torch.Tensor  # uint8 [out, groups * kernel_group / 2], cpu_linear.pack_int4's layout
    scales: torch.Tensor  # float32 [out, groups]
    offsets: torch.Tensor  # float32 [out, groups]: zero - 8 * scale, so a weight is code * scale + offset

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(qw, bias, dtype)
        if qw.bits != 4:
            raise ModelLoadError("Int4WeightLinear takes 4-bit weights")
        in_f = qw.shape[1]
        groups = qw.scales.shape[1]
        if groups > 1 and qw.group_size % GROUP_MULTIPLE:
            raise ModelLoadError(
                f"a 4-bit layer in groups of {qw.group_size} input columns cannot run on the CPU int4 kernel: the "
                f"group size must be a multiple of {GROUP_MULTIPLE}"
            )
        # One scale per channel is one group: padded to the kernel's multiple of 32 columns (zero activations there).
        self.kernel_group = qw.group_size if groups > 1 else -(-in_f // GROUP_MULTIPLE) * GROUP_MULTIPLE
        padded = groups * self.kernel_group
        q = torch.nn.functional.pad(qw.q, (0, padded - in_f), value=8) if padded != in_f else qw.q
        self.register_buffer("qweight", cpu_linear.pack_int4(q))
        scales = qw.scales.to(torch.float32)
        zeros = torch.zeros_like(scales) if qw.zeros is None else qw.zeros.to(torch.float32)
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("offsets", (zeros - 8 * scales).contiguous())
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The int4 matmul; the result in the activation dtype."""
        x2 = self._prepare(x.to(self.dtype))
        padded = self.qweight.shape[1] * 2
        if padded != self.in_features:
            x2 = torch.nn.functional.pad(x2, (0, padded - self.in_features))
        y = cpu_linear.int4_linear(x2, self.qweight, self.scales, self.offsets, self.kernel_group)
        if y is None:
            out_f, groups = self.scales.shape
            codes = cpu_linear.unpack_int4(self.qweight).view(out_f, groups, self.kernel_group).to(torch.float32)
            weight = codes * self.scales.unsqueeze(-1) + self.offsets.unsqueeze(-1)
            y = torch.nn.functional.linear(x2, weight.view(out_f, -1).to(x2.dtype))
        return self._finish(y.to(self.dtype), x)


def packed_linear(qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> _PackedLinear:
    """The packed layer for ``qw``'s bit width."""
    return Int8WeightLinear(qw, bias, dtype) if qw.bits == 8 else Int4WeightLinear(qw, bias, dtype)
