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
    """What both packed layers share: the shape attributes of ``nn.Linear``, the bias, the input permutation, and the
    kernel's column layout (``kernel_group`` columns per group, the input zero-padded to ``groups * kernel_group``)."""

    scales: torch.Tensor  # float32 [out, groups]

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.group_size = qw.group_size
        self.dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.perm: torch.Tensor | None
        self.register_buffer("perm", qw.perm)
        self.register_buffer("scales", qw.scales.to(torch.float32).contiguous())
        groups = qw.scales.shape[1]
        # One scale per channel is one group: padded to the kernel's multiple of 32 columns (zero activations there).
        self.kernel_group = qw.group_size if groups > 1 else -(-self.in_features // GROUP_MULTIPLE) * GROUP_MULTIPLE
        self.padded_in = groups * self.kernel_group

    def _padded_codes(self, q: torch.Tensor, value: int) -> torch.Tensor:
        """``q [out, in]`` padded with ``value`` to ``padded_in`` columns."""
        pad = self.padded_in - self.in_features
        return torch.nn.functional.pad(q, (0, pad), value=value) if pad else q

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``[rows, padded_in]`` in the activation dtype, permuted and zero-padded."""
        x2 = x.to(self.dtype).reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.padded_in != self.in_features:
            return torch.nn.functional.pad(x2, (0, self.padded_in - self.in_features))
        return x2.contiguous()

    def _dequantized_matmul(self, x2: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
        """``x2 @ (codes * scale + offset).T`` through torch's matmul, the weight dequantized in float32 first."""
        out_f, groups = self.scales.shape
        weight = codes.view(out_f, groups, self.kernel_group).to(torch.float32) * self.scales.unsqueeze(-1)
        if offsets is not None:
            weight = weight + offsets.unsqueeze(-1)
        return torch.nn.functional.linear(x2, weight.view(out_f, -1).to(x2.dtype))

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = y.to(self.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int8WeightLinear(_PackedLinear):
    """``y = x @ (q * scale).T + bias`` with ``q`` int8: vllite's compiled kernel at decode batch sizes; else torch's
    ``_weight_int8pack_mm`` (one scale per channel, no compiled kernel) or, for prefill and group-wise scales without
    the kernel, the weight dequantized for torch's matmul."""

    qweight: torch.Tensor  # int8 [out, padded_in], columns zero-padded

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        if qw.bits != 8 or qw.zeros is not None:
            raise ModelLoadError("Int8WeightLinear takes symmetric 8-bit weights")
        super().__init__(qw, bias, dtype)
        self.register_buffer("qweight", self._padded_codes(qw.q, 0).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 matmul; the result in the activation dtype."""
        x2 = self._prepare(x)
        y = cpu_linear.int8_linear(x2, self.qweight, self.scales, self.kernel_group)
        if y is None:
            if self.scales.shape[1] == 1 and x2.shape[0] <= cpu_linear.MAX_ROWS:
                y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales[:, 0].to(x2.dtype))
            else:
                y = self._dequantized_matmul(x2, self.qweight, None)
        return self._finish(y, x)


class Int4WeightLinear(_PackedLinear):
    """``y = x @ ((q - 8) * scale + zero).T + bias`` with ``q`` 0..15 packed two per byte: vllite's compiled kernel at
    decode batch sizes, else the weight unpacked and dequantized for torch's matmul."""

    qweight: torch.Tensor  # uint8 [out, padded_in / 2], cpu_linear.pack_int4's layout
    offsets: torch.Tensor  # float32 [out, groups]: zero - 8 * scale, so a weight is code * scale + offset

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        if qw.bits != 4:
            raise ModelLoadError("Int4WeightLinear takes 4-bit weights")
        if qw.scales.shape[1] > 1 and qw.group_size % GROUP_MULTIPLE:
            raise ModelLoadError(
                f"a 4-bit layer in groups of {qw.group_size} input columns cannot run on the CPU int4 kernel: the "
                f"group size must be a multiple of {GROUP_MULTIPLE}"
            )
        super().__init__(qw, bias, dtype)
        self.register_buffer("qweight", cpu_linear.pack_int4(self._padded_codes(qw.q, 8)))
        zeros = torch.zeros_like(self.scales) if qw.zeros is None else qw.zeros.to(torch.float32)
        self.register_buffer("offsets", (zeros - 8 * self.scales).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The int4 matmul; the result in the activation dtype."""
        x2 = self._prepare(x)
        y = cpu_linear.int4_linear(x2, self.qweight, self.scales, self.offsets, self.kernel_group)
        if y is None:
            y = self._dequantized_matmul(x2, cpu_linear.unpack_int4(self.qweight), self.offsets)
        return self._finish(y, x)


def packed_linear(qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> _PackedLinear:
    """The packed layer for ``qw``'s bit width."""
    return Int8WeightLinear(qw, bias, dtype) if qw.bits == 8 else Int4WeightLinear(qw, bias, dtype)
