"""Paged KV-cache kernels: Triton on CUDA tensors, a variable-length SDPA path on CPU tensors.

Public entry points (see :mod:`vllite.kernels.reference` for the full contract):

* ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, plan=None, k_scale=1.0, v_scale=1.0)
  -> None``
* ``paged_attention(query, key_cache, value_cache, params, *, out=None) -> Tensor``, where ``params`` is a
  :class:`~vllite.kernels.params.PagedAttentionParams`: the step's ``block_tables``, ``seq_lens``,
  ``query_start_loc``, ``max_query_len`` and ``max_seq_len``, the layer's ``scale``, ``sliding_window`` and
  ``softcap``, and the ``plan`` below. Every backend takes the same arguments.
* ``plan_paged_attention(...)``: the per-step plan of the CPU path (``None`` elsewhere), built once per forward
  pass and passed to every layer's calls (as ``PagedAttentionParams.plan`` and ``reshape_and_cache(plan=)``).
* ``varlen_attention(query, key, value, cu_seqlens, max_seqlen, scale, causal=False) -> Tensor``: attention within
  each sequence of a packed batch, without a cache (bidirectional for encoder models); see
  :mod:`vllite.kernels.varlen_attention`.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys and for values. The cache may
be fp8 (``--kv-cache-dtype fp8``, :mod:`vllite.kernels.kv_cache_dtype`) on the CPU paths, with the layer's
``k_scale`` / ``v_scale`` given to the write and carried by ``PagedAttentionParams``; the Triton kernels do not
read fp8.
CPU tensors take :mod:`vllite.kernels.cpu_attention` (cost follows each sequence's own context length);
``VLLITE_CPU_ATTENTION=reference`` selects the torch reference (:mod:`vllite.kernels.reference`) instead, which
is also the path of CUDA tensors when triton is unavailable or ``VLLITE_DISABLE_TRITON=1``.
Importing this package imports neither torch nor triton; torch loads on the first call, triton only when a
CUDA tensor takes the Triton path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllite.kernels.dispatch import is_triton_available, use_cpu_fast_path, use_triton
from vllite.kernels.params import PagedAttentionParams
from vllite.kernels.varlen_attention import varlen_attention

if TYPE_CHECKING:
    from torch import Tensor

    from vllite.kernels.cpu_plan import CpuAttentionPlan

__all__ = [
    "PagedAttentionParams",
    "is_triton_available",
    "paged_attention",
    "plan_paged_attention",
    "reshape_and_cache",
    "use_cpu_fast_path",
    "use_triton",
    "varlen_attention",
]


def plan_paged_attention(
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    *,
    key_cache: Tensor,
    num_heads: int,
    sliding_window: int | None = None,
    slot_mapping: Tensor | None = None,
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
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    *,
    plan: CpuAttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches in place.

    ``slot_mapping`` ``[num_tokens]`` int64 holds ``block_id * block_size + offset`` per token; ``-1``
    skips the token. An fp8 cache stores ``key / k_scale`` and ``value / v_scale``, saturated (CPU paths only).
    Dispatches to :func:`~vllite.kernels.triton_attention.reshape_and_cache_triton` for CUDA tensors, to
    :func:`~vllite.kernels.cpu_attention.reshape_and_cache_cpu` (with ``plan``'s prepared slots when it has them)
    for CPU tensors and to :func:`~vllite.kernels.reference.reshape_and_cache_ref` otherwise.
    """
    if use_triton(key):
        from vllite.kernels.triton_attention import reshape_and_cache_triton

        if key_cache.element_size() == 1:
            from vllite.exceptions import DeviceUnavailableError

            raise DeviceUnavailableError("The Triton kernels read no fp8 KV cache: it is implemented on the CPU path.")
        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    elif use_cpu_fast_path(key_cache):
        from vllite.kernels.cpu_attention import reshape_and_cache_cpu

        slots = slot_mapping if plan is None or plan.slots is None else plan.slots
        reshape_and_cache_cpu(key, value, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale)
    else:
        from vllite.kernels.reference import reshape_and_cache_ref

        reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def paged_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, params: PagedAttentionParams, *, out: Tensor | None = None
) -> Tensor:
    """Causal GQA attention of packed ``query`` ``[num_tokens, num_heads, head_dim]`` over the paged cache.

    Returns ``[num_tokens, num_heads, value_head_dim]`` in ``query``'s dtype (``out`` when given). ``params`` holds
    the step's batch layout, the layer's scale, window, softcap and sinks, and the plan of :func:`plan_paged_attention`
    (see :class:`~vllite.kernels.params.PagedAttentionParams` and
    :func:`vllite.kernels.reference.paged_attention_ref` for the contract). Triton for CUDA tensors,
    :func:`~vllite.kernels.cpu_attention.paged_attention_cpu` for CPU tensors (planning itself when
    ``params.plan`` is ``None``), the vectorised torch reference otherwise.
    """
    if use_cpu_fast_path(query):
        from vllite.kernels.cpu_attention import paged_attention_cpu as attention
    elif use_triton(query):
        from vllite.kernels.triton_attention import paged_attention_triton as attention
    else:
        from vllite.kernels.reference import paged_attention_ref as attention
    return attention(query, key_cache, value_cache, params, out=out)
