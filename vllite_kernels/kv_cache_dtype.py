"""The KV cache's element type: ``--kv-cache-dtype`` (vLLM's flag) and the fp8 quantization it implies.

``auto`` stores keys and values in the model's dtype. ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2`` store them as
``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, one byte each, with a per-layer ``k_scale`` / ``v_scale``: a write
stores ``value / scale`` saturated to the format's finite range (what vLLM's ``scaled_fp8_conversion`` does), a read
widens the byte and multiplies by ``scale``; scores and sums stay float32. vllite uses vLLM's default scale, 1.0, for
every layer (it does not read ``k_scale`` / ``v_scale`` from checkpoints).

Importing this module imports no torch (the CLI validates the names); torch loads on the first dtype lookup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllite.config import KV_CACHE_DTYPES

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = ["FP8_KV_CACHE_DTYPES", "KV_CACHE_DTYPES", "dequantize_kv", "is_fp8", "kv_cache_torch_dtype", "quantize_kv"]

#: The fp8 values of ``--kv-cache-dtype`` (``vllite.config.KV_CACHE_DTYPES``, as in vLLM; ``fp8`` is ``fp8_e4m3``).
FP8_KV_CACHE_DTYPES = tuple(name for name in KV_CACHE_DTYPES if name != "auto")


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the KV cache takes for ``--kv-cache-dtype name`` (``auto``: ``model_dtype``); a
    ``ValueError`` naming the flag and its values for any other name."""
    import torch

    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if name == "fp8_e5m2":
        return torch.float8_e5m2
    raise ValueError(f"--kv-cache-dtype (kv_cache_dtype) must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}.")


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the fp8 KV-cache types."""
    import torch

    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: Tensor, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    """``x`` as cache elements of ``dtype``: for fp8, ``x / scale`` saturated to the format's finite range (e5m2
    would otherwise round large values to infinity); other dtypes are a plain cast."""
    import torch

    if not is_fp8(dtype):
        return x.to(dtype)
    bound = torch.finfo(dtype).max
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp_(-bound, bound).to(dtype)


def dequantize_kv(x: Tensor, dtype: torch.dtype, scale: float = 1.0, *, out: Tensor | None = None) -> Tensor:
    """Cache elements ``x`` widened to ``dtype`` (into ``out`` when given), multiplied by ``scale`` when ``x`` is fp8
    (a float cache has no scale; ``x`` itself may be returned then, never modified)."""
    if out is None:
        out = x.to(dtype)
    else:
        out.copy_(x)
    if scale != 1.0 and is_fp8(x.dtype):
        out.mul_(scale)
    return out
