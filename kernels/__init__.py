"""Paged KV-cache kernels: Triton on CUDA tensors, the torch reference everywhere else.

Public entry points (see :mod:`vllite.kernels.reference` for the full contract):

* ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None``
* ``paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *,
  max_query_len, max_seq_len, scale, sliding_window=None, softcap=None, out=None) -> Tensor``

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys and for values.
Importing this package imports neither torch nor triton; torch loads on the first call, triton only when a
CUDA tensor takes the Triton path. ``VLLITE_DISABLE_TRITON=1`` forces the reference path on CUDA too.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["is_triton_available", "paged_attention", "reshape_and_cache", "use_triton"]


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


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches in place.

    ``slot_mapping`` ``[num_tokens]`` int64 holds ``block_id * block_size + offset`` per token; ``-1``
    skips the token.
    Dispatches to :func:`~vllite.kernels.triton_attention.reshape_and_cache_triton` for CUDA tensors and to
    :func:`~vllite.kernels.reference.reshape_and_cache_ref` otherwise.
    """
    if use_triton(key):
        from vllite.kernels.triton_attention import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
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
) -> torch.Tensor:
    """Causal GQA attention of packed ``query`` ``[num_tokens, num_heads, head_dim]`` over the paged cache.

    Returns ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype (``out`` when given). See
    :func:`vllite.kernels.reference.paged_attention_ref` for every argument. Triton for CUDA tensors,
    the vectorised torch reference otherwise.
    """
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
