"""Paged KV-cache kernels: Triton on CUDA tensors, a variable-length SDPA path on CPU tensors.

Public entry points (see :mod:`vllite.kernels.reference` for the full contract):

* ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, plan=None) -> None``
* ``paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *,
  max_query_len, max_seq_len, scale, sliding_window=None, softcap=None, out=None, plan=None) -> Tensor``
* ``plan_paged_attention(...)``: the per-step plan of the CPU path (``None`` elsewhere), built once per forward
  pass and passed to every layer's calls as ``plan=``.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys and for values.
CPU tensors take :mod:`vllite.kernels.cpu_attention` (cost follows each sequence's own context length);
``VLLITE_CPU_ATTENTION=reference`` selects the torch reference (:mod:`vllite.kernels.reference`) instead, which
is also the path of CUDA tensors when triton is unavailable or ``VLLITE_DISABLE_TRITON=1``.
Importing this package imports neither torch nor triton; torch loads on the first call, triton only when a
CUDA tensor takes the Triton path.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from vllite.kernels.cpu_plan import CpuAttentionPlan

__all__ = [
    "is_triton_available",
    "paged_attention",
    "plan_paged_attention",
    "reshape_and_cache",
    "use_cpu_fast_path",
    "use_triton",
]


@functools.cache
def is_triton_available() -> bool:
    """True when triton is installed, CUDA is available to torch, and ``VLLITE_DISABLE_TRITON`` is unset.

    Cached after the first call; does not import triton.
    """
    if os.environ.get("VLLITE_DISABLE_TRITON", "") not in ("", "0"):
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    return torch.cuda.is_available()


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the dispatchers below send work on ``tensor`` to the Triton kernels (CUDA tensor + triton)."""
    return tensor.is_cuda and is_triton_available()


@functools.cache
def _cpu_reference_selected() -> bool:
    return os.environ.get("VLLITE_CPU_ATTENTION", "").strip().lower() in ("reference", "ref")


def use_cpu_fast_path(tensor: torch.Tensor) -> bool:
    """Whether work on ``tensor`` goes to :mod:`vllite.kernels.cpu_attention` (a CPU tensor, unless
    ``VLLITE_CPU_ATTENTION=reference``, read once per process)."""
    return tensor.device.type == "cpu" and not _cpu_reference_selected()


def plan_paged_attention(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    key_cache: torch.Tensor,
    num_heads: int,
    sliding_window: int | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> CpuAttentionPlan | None:
    """The step's plan for the CPU path over caches like ``key_cache`` (``None`` where that path is not used).

    Depends only on the metadata, the block size and ``sliding_window``: build it once per forward pass (per
    distinct window) and pass it to every layer's :func:`paged_attention` and :func:`reshape_and_cache`.
    ``slot_mapping``, when given, is prepared for the cache writes too.
    """
    if not use_cpu_fast_path(key_cache):
        return None
    from vllite.kernels.cpu_plan import plan_paged_attention_cpu

    return plan_paged_attention_cpu(
        block_tables,
        seq_lens,
        query_start_loc,
        block_size=key_cache.shape[1],
        num_heads=num_heads,
        num_kv_heads=key_cache.shape[2],
        head_dim=key_cache.shape[3],
        sliding_window=sliding_window,
        slot_mapping=slot_mapping,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    plan: CpuAttentionPlan | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches in place.

    ``slot_mapping`` ``[num_tokens]`` int64 holds ``block_id * block_size + offset`` per token; ``-1``
    skips the token.
    Dispatches to :func:`~vllite.kernels.triton_attention.reshape_and_cache_triton` for CUDA tensors, to
    :func:`~vllite.kernels.cpu_attention.reshape_and_cache_cpu` (using ``plan``'s prepared slots) for CPU
    tensors and to :func:`~vllite.kernels.reference.reshape_and_cache_ref` otherwise.
    """
    if use_triton(key):
        from vllite.kernels.triton_attention import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    elif use_cpu_fast_path(key_cache):
        from vllite.kernels.cpu_attention import reshape_and_cache_cpu

        reshape_and_cache_cpu(key, value, key_cache, value_cache, slot_mapping, plan=plan)
    else:
        from vllite.kernels.reference import reshape_and_cache_ref

        reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    plan: CpuAttentionPlan | None = None,
) -> torch.Tensor:
    """Causal GQA attention of packed ``query`` ``[num_tokens, num_heads, head_dim]`` over the paged cache.

    Returns ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype (``out`` when given). See
    :func:`vllite.kernels.reference.paged_attention_ref` for every argument. Triton for CUDA tensors,
    :func:`~vllite.kernels.cpu_attention.paged_attention_cpu` for CPU tensors (with ``plan`` from
    :func:`plan_paged_attention`, or planning itself), the vectorised torch reference otherwise.
    """
    if use_cpu_fast_path(query):
        from vllite.kernels.cpu_attention import paged_attention_cpu

        return paged_attention_cpu(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            out=out,
            plan=plan,
        )
    if use_triton(query):
        from vllite.kernels.triton_attention import paged_attention_triton as attention
    else:
        from vllite.kernels.reference import paged_attention_ref as attention
    return attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        out=out,
    )
