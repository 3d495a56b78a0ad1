"""A compiled CPU kernel for decode attention that reads the paged KV cache in place.

Decode is where a CPU engine spends its attention time, and it is memory-bound: each new token reads its whole
context once per layer. The torch path (:mod:`vllite.kernels.cpu_attention`) first gathers every context's blocks
into one buffer and then runs SDPA on it, so the context crosses the memory bus three times (read, write, read);
on a machine whose cores share that bus (measured here: two concurrent copy streams get 1.44x one stream, two
concurrent matmul loops 2.0x) that caps both a step and data-parallel scaling. This kernel follows each
sequence's block table instead: one pass over its keys for the scores and one over its values, OpenMP-parallel
over (sequence, KV head) through torch's thread pool, the group's query heads sharing each key and value row.

Built once per machine with ``torch.utils.cpp_extension.load_inline`` (the C++ compiler torch was built with;
about a minute) into torch's extension cache, and loaded from there afterwards. Float32 only; when no compiler is
found or the build fails, :func:`decode_kernel` returns ``None`` (logged once) and the torch path serves decode.
``VLLITE_CPU_DECODE_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["decode_kernel", "paged_decode_attention"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// out, q: [n, H, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [n, max_blocks] int32;
// seq_lens: [n] int32. Sequence s attends to its first seq_lens[s] cached tokens.
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv, MB = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t row = Hkv * D;  // floats between consecutive tokens of one KV head
  at::parallel_for(0, n * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / Hkv, h = w % Hkv, L = sl[s];
      const float* qs = qp + (s * H + h * G) * D;
      float* o = op + (s * H + h * G) * D;
      if (L <= 0) { std::fill(o, o + G * D, 0.f); continue; }
      scores.resize(L * G);  // scores[g * L + t]
      const int32_t* blocks = bt + s * MB;
      for (int64_t t = 0; t < L; ++t) {
        const float* kr = kp + (static_cast<int64_t>(blocks[t / BS]) * BS + t % BS) * row + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * kr[d];
          scores[g * L + t] = dot * fscale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * L;
        float mx = sc[0];
        for (int64_t t = 1; t < L; ++t) mx = std::max(mx, sc[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sc[t] = std::exp(sc[t] - mx);
          sum += sc[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* vr = vp + (static_cast<int64_t>(blocks[t / BS]) * BS + t % BS) * row + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
        }
      }
      std::copy(acc.begin(), acc.end(), o);
    }
  });
}
"""
_CPP_DECL = (
    "void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, "
    "torch::Tensor block_tables, torch::Tensor seq_lens, double scale);"
)


#: Compiler flags. -fopenmp: at::parallel_for's OpenMP loop (torch's thread pool) is compiled in only with it;
#: fast-math lets the dot products and exp vectorize (the inputs are finite; -inf is never formed).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
#: The module name carries a hash of the source and flags, so a changed kernel is rebuilt, never loaded stale.
_NAME = "vllite_cpu_decode_" + hashlib.sha256("\0".join([_SOURCE, *_CFLAGS]).encode()).hexdigest()[:12]


@functools.cache
def decode_kernel() -> Any | None:
    """The compiled module (built on first use, about half a minute, then loaded from torch's extension cache), or
    ``None`` when it cannot be built or is turned off with ``VLLITE_CPU_DECODE_KERNEL=0``."""
    if os.environ.get("VLLITE_CPU_DECODE_KERNEL", "1") == "0":
        return None
    built = _load_built()
    if built is not None:
        return built
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("No C++ compiler found: CPU decode attention uses the torch path (gather + SDPA).")
        return None
    from torch.utils.cpp_extension import load_inline

    logger.info("Building the CPU decode-attention kernel %s (once per machine, about half a minute)", _NAME)
    try:
        return load_inline(
            name=_NAME,
            cpp_sources=[_CPP_DECL, _SOURCE],
            functions=["paged_decode"],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # a broken toolchain must not take the engine down: the torch path still works
        logger.warning("Building the CPU decode-attention kernel failed (%s); using the torch path.", exc)
        return None


def _load_built() -> Any | None:
    """The module from an earlier build, imported directly (``load_inline`` would re-check the build, ~1 s)."""
    from torch.utils.cpp_extension import _get_build_directory

    path = os.path.join(_get_build_directory(_NAME, verbose=False), f"{_NAME}.so")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:
        return None  # built for another torch: rebuild
    return module


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Decode attention (one query token per sequence, ``query [n, H, D]``) read through the block tables, or
    ``None`` when the kernel does not apply (no kernel, not float32, non-contiguous caches)."""
    kernel = decode_kernel()
    if kernel is None or query.dtype != torch.float32 or key_cache.dtype != torch.float32:
        return None
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    n = query.shape[0]
    result = out if out is not None and out.is_contiguous() and out.dtype == torch.float32 else None
    result = torch.empty_like(query) if result is None else result
    kernel.paged_decode(
        result,
        query.contiguous(),
        key_cache,
        value_cache,
        block_tables[:n].to(torch.int32).contiguous(),
        seq_lens[:n].to(torch.int32).contiguous(),
        scale,
    )
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result
