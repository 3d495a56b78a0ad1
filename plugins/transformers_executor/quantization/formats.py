"""Reading one quantized layer's tensors from a checkpoint into one canonical form, per on-disk format.

The canonical form (:class:`QuantizedWeight`) is what the packed linear layers are built from: integer codes
``q`` of shape ``[out, in]`` (signed int8 for 8 bits; unsigned 0..15 for 4 bits, so that the weight is
``(q - 8) * scale + zero``), one scale (and for 4 bits one additive zero) per output channel and group of input
columns, and an optional input-column permutation (GPTQ's ``desc_act`` / compressed-tensors' ``actorder``) that
makes every group contiguous. Nothing is dequantized to a float weight.

Format sources:

- compressed-tensors ``pack-quantized`` (``compressed_tensors.compressors.pack_quantized``): ``weight_packed`` int32
  ``[out, ceil(in * bits / 32)]``, element ``i`` of a row at bit ``i * bits`` (little-endian) stored as
  ``q + 2**(bits-1)``; ``weight_shape`` ``[out, in]``; ``weight_scale`` ``[out, groups]`` (``[out, 1]`` per channel,
  one value per tensor); optional ``weight_g_idx`` ``[in]``.
- compressed-tensors ``int-quantized`` / ``naive-quantized``: ``weight`` int8 ``[out, in]`` holding ``q``, and
  ``weight_scale`` as above.
- GPTQ (AutoGPTQ's ``QuantLinear.pack``): ``qweight`` int32 ``[in / 8, out]`` (input row ``8i + j`` at bits
  ``4j`` of row ``i``), ``qzeros`` int32 ``[groups, out / 8]`` (output column ``8c + j`` at bits ``4j``), stored as
  ``zero - 1`` in the ``gptq`` (v1) format and as ``zero`` in ``gptq_v2``; ``scales`` ``[groups, out]``; ``g_idx``
  ``[in]`` (the group of each input row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllite.exceptions import ModelLoadError
from vllite.plugins.transformers_executor.quantization.config import WeightScheme

#: A getter of the layer's tensors by local name (``weight_scale`` ...); ``None`` when the checkpoint lacks it.
TensorGetter = Callable[[str], "torch.Tensor | None"]


@dataclass
class QuantizedWeight:
    """One linear layer's weight, still quantized (see the module docstring)."""

    bits: int
    q: torch.Tensor  # [out, in]: int8 codes (8 bits) or int32 0..15 (4 bits), columns already permuted by ``perm``
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor | None  # float32 [out, groups], additive (4 bits only); None: symmetric around code 8
    group_size: int  # input columns per group (``in`` for one scale per channel)
    perm: torch.Tensor | None  # int64 [in]: x[:, perm] feeds the permuted columns; None: identity

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return int(self.q.shape[0]), int(self.q.shape[1])


def unpack_int32_rows(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Unpacks the codes packed little-endian along the last dimension of int32 ``packed``; unsigned int32."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)
    if codes.shape[-1] < cols:
        raise ModelLoadError(f"packed weight holds {codes.shape[-1]} values per row, fewer than {cols}")
    return codes[..., :cols]


def read_compressed_tensors(name: str, get: TensorGetter, scheme: WeightScheme) -> QuantizedWeight:
    """A compressed-tensors layer (``pack-quantized``, ``int-quantized`` or ``naive-quantized``)."""
    bits = scheme.bits
    if scheme.fmt == "pack-quantized":
        packed, shape = _require(name, get, "weight_packed"), _require(name, get, "weight_shape")
        out_f, in_f = (int(v) for v in shape.tolist())
        if packed.dtype != torch.int32 or packed.shape[0] != out_f:
            raise ModelLoadError(
                f"{name}.weight_packed {tuple(packed.shape)} does not fit weight_shape {shape.tolist()}"
            )
        signed = unpack_int32_rows(packed, bits, in_f) - (1 << (bits - 1))
    else:
        signed = _require(name, get, "weight")
        if signed.dtype != torch.int8:
            raise ModelLoadError(f"{name}.weight is {signed.dtype}, not int8: the layer is not compressed")
        out_f, in_f = signed.shape
    scale = _require(name, get, "weight_scale").float()
    if scale.numel() == 1:  # one scale per tensor
        scale = scale.reshape(1, 1).expand(out_f, 1)
    scale = scale.reshape(out_f, -1) if scale.dim() == 1 else scale
    group = _group_size(name, scheme.group_size, in_f, scale, "weight_scale")
    perm = _group_permutation(name, get("weight_g_idx"), in_f, group)
    if perm is not None:
        signed = signed[:, perm]
    if bits == 8:
        return QuantizedWeight(8, signed.to(torch.int8).contiguous(), scale.contiguous(), None, group, perm)
    return QuantizedWeight(4, (signed.to(torch.int32) + 8).contiguous(), scale.contiguous(), None, group, perm)


def read_gptq(name: str, get: TensorGetter, scheme: WeightScheme, desc_act: bool) -> QuantizedWeight:
    """A GPTQ 4-bit layer: the weight is ``(q - zero) * scale = (q - 8) * scale + (8 - zero) * scale``."""
    qweight, qzeros = _require(name, get, "qweight"), _require(name, get, "qzeros")
    scales = _require(name, get, "scales").float()
    in_f, out_f = qweight.shape[0] * 8, qweight.shape[1]
    q = unpack_int32_rows(qweight.t().contiguous(), 4, in_f)  # [out, in]
    zeros = unpack_int32_rows(qzeros, 4, out_f).t().float()  # [out, groups]
    if scheme.fmt == "gptq":
        zeros = zeros + 1  # v1 checkpoints store zero - 1 (AutoGPTQ's historical offset)
    scale = scales.t()
    if scale.shape != zeros.shape:
        raise ModelLoadError(f"{name}.scales {tuple(scales.shape)} and qzeros {tuple(qzeros.shape)} disagree")
    group = _group_size(name, scheme.group_size, in_f, scale, "scales")
    g_idx = get("g_idx")
    perm = _group_permutation(name, g_idx, in_f, group)
    if perm is not None:
        q = q[:, perm]
    elif desc_act and g_idx is None:
        raise ModelLoadError(f"{name}.g_idx is missing but quantization_config.desc_act is true")
    additive = (8.0 - zeros) * scale
    return QuantizedWeight(4, q.contiguous(), scale.contiguous(), additive.contiguous(), group, perm)


def _require(name: str, get: TensorGetter, key: str) -> torch.Tensor:
    tensor = get(key)
    if tensor is None:
        raise ModelLoadError(f"the checkpoint has no {name}.{key}: the quantized layer is incomplete")
    return tensor


def _group_size(name: str, group: int | None, in_f: int, scale: torch.Tensor, scale_key: str) -> int:
    """The group size, checked against the number of scale columns (``group_size`` vs the weight's shape)."""
    size = in_f if group is None or group >= in_f else group
    expected = -(-in_f // size)
    if scale.shape[1] != expected:
        raise ModelLoadError(
            f"quantization_config.group_size={group} does not fit {name}: {in_f} input columns need {expected} "
            f"scale groups but {name}.{scale_key} has shape {tuple(scale.shape)}"
        )
    return size


def _group_permutation(name: str, g_idx: torch.Tensor | None, in_f: int, group: int) -> torch.Tensor | None:
    """The input-column order that makes each group contiguous, or ``None`` when ``g_idx`` is trivial/absent."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64).reshape(-1)
    if g_idx.numel() != in_f:
        raise ModelLoadError(f"{name}.g_idx has {g_idx.numel()} entries for {in_f} input columns")
    trivial = torch.arange(in_f) // group
    if torch.equal(g_idx, trivial):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], trivial):
        raise ModelLoadError(f"{name}.g_idx does not assign {group} input columns to each group")
    return perm
