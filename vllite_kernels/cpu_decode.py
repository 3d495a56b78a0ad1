"""A compiled CPU kernel for decode attention that reads the paged KV cache in place.

Decode is where a CPU engine spends its attention time, and it is memory-bound: each new token reads its whole
context once per layer. The torch path (:mod:`vllite.kernels.cpu_attention`) first gathers every context's blocks
into one buffer and then runs SDPA on it, so the context crosses the memory bus three times (read, write, read);
on a machine whose cores share that bus (measured here: two concurrent copy streams get 1.44x one stream, two
concurrent matmul loops 2.0x) that caps both a step and data-parallel scaling. This kernel
(``cpu_decode.cpp``) follows each sequence's block table instead: one pass over its keys for the scores and one
over its values, each block fetched from memory once (prefetched while the one before is processed), the group's
query heads sharing each key and value row, whole sequences handed to torch's OpenMP threads longest first. One
layer's decode over 256 contexts of 16-800 tokens in shuffled blocks: 41-44 ms through the torch path, 22 ms with
this kernel's first version (one work item per sequence x KV head, striding through every block Hkv times),
10.1 ms now.

Built once per machine with ``torch.utils.cpp_extension.load_inline`` (the C++ compiler torch was built with;
about a minute) into torch's extension cache, and loaded from there afterwards. The cache may be float32, bfloat16
or fp8 (e4m3 or e5m2, with the layer's ``k_scale`` / ``v_scale``), widened to float32 as it is read: a bfloat16
cache halves the bytes decode reads, an fp8 one quarters them. fp8 is widened eight elements at a time through the
F16C half-precision conversion where the CPU has AVX2 (e5m2 is the high byte of a float16; e4m3 moves into a
float16's bit positions and is rescaled by 2^8), else through a 256-entry table per format; :func:`widen_fp8` exports
that widening for the gather path. When no compiler is
found or the build fails, :func:`decode_kernel` returns ``None`` (logged once) and the torch path serves decode.
``VLLITE_CPU_DECODE_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vllite.kernels.cpp_build import load_cpp_module

__all__ = ["decode_kernel", "paged_decode_attention", "widen_fp8"]

_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_QUERY_DTYPES = (torch.float32, torch.bfloat16)
_CPP_DECL = (
    "void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, "
    "torch::Tensor block_tables, torch::Tensor seq_lens, double scale, double k_scale, double v_scale);\n"
    "void widen_fp8(torch::Tensor out, torch::Tensor in, double scale);"
)


@functools.cache
def decode_kernel() -> Any | None:
    """The compiled module (built on first use, about half a minute, then loaded from torch's extension cache), or
    ``None`` when it cannot be built or is turned off with ``VLLITE_CPU_DECODE_KERNEL=0``."""
    return load_cpp_module(
        "cpu_decode.cpp",
        _CPP_DECL,
        ["paged_decode", "widen_fp8"],
        "the CPU decode-attention kernel",
        switch="VLLITE_CPU_DECODE_KERNEL",
    )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Decode attention (one query token per sequence, ``query [n, H, D]``) read through the block tables, or
    ``None`` when the kernel does not apply (no kernel, a cache neither float32, bfloat16 nor fp8, non-contiguous
    caches). An fp8 cache element reads as ``element * k_scale`` (``v_scale`` for values; both ignored for other
    cache dtypes). Scores and sums are float32 whatever the dtype; the result has ``query``'s dtype."""
    kernel = decode_kernel()
    if kernel is None or key_cache.dtype not in _CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        return None
    if query.dtype not in _QUERY_DTYPES or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    n = query.shape[0]
    usable = out is not None and out.is_contiguous() and out.dtype == torch.float32
    result = out if out is not None and usable else torch.empty(query.shape, dtype=torch.float32)
    kernel.paged_decode(
        result,
        query.to(torch.float32).contiguous(),
        key_cache,
        value_cache,
        block_tables[:n].to(torch.int32).contiguous(),
        seq_lens[:n].to(torch.int32).contiguous(),
        scale,
        k_scale,
        v_scale,
    )
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result if query.dtype == torch.float32 else result.to(query.dtype)


def widen_fp8(cache: torch.Tensor, scale: float, out: torch.Tensor) -> bool:
    """Writes the fp8 tensor ``cache`` times ``scale`` into the float32 tensor ``out`` of the same size with the
    compiled module (vectorised; torch converts fp8 element by element); ``False``, nothing written, where it does not
    apply (no kernel, another dtype, non-contiguous tensors)."""
    kernel = decode_kernel()
    if kernel is None or cache.dtype not in _CACHE_DTYPES[2:] or out.dtype != torch.float32:
        return False
    if not (cache.is_contiguous() and out.is_contiguous()) or cache.numel() != out.numel():
        return False
    kernel.widen_fp8(out, cache, scale)
    return True
