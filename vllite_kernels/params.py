"""What every paged-attention kernel takes besides the layer's tensors, and the checks they share.

:class:`PagedAttentionParams` bundles one step's batch layout (block tables, sequence lengths, query offsets and
their maxima) with the layer's attention settings (scale, sliding window, softcap) and, on the CPU path, the
step's plan. It is built once per step and attention configuration (a forward pass reuses it across layers) and
passed to :func:`vllite.kernels.paged_attention` and to each of its backends
(:func:`~vllite.kernels.reference.paged_attention_ref`, :func:`~vllite.kernels.cpu_attention.paged_attention_cpu`,
:func:`~vllite.kernels.triton_attention.paged_attention_triton`), which all share the signature
``(query, key_cache, value_cache, params, *, out=None) -> Tensor``. :func:`gqa_group` is their shared check of the
head counts.

Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from vllite.kernels.cpu_plan import CpuAttentionPlan

__all__ = ["PagedAttentionParams", "gqa_group"]


@dataclass(frozen=True, slots=True)
class PagedAttentionParams:
    """The arguments of a paged-attention call other than ``query``, the caches and ``out``.

    Attributes:
        block_tables: ``[num_seqs, max_blocks_per_seq]`` integer block ids; entries past a sequence's length are
            ignored (they may hold any value).
        seq_lens: ``[num_seqs]`` integer, total context length including this step's query tokens.
        query_start_loc: ``[num_seqs + 1]`` integer cumulative query offsets into ``query``.
        max_query_len, max_seq_len: upper bounds of the query lengths and of ``seq_lens``.
        scale: multiplier of ``q @ k``, applied after the matmul (as Hugging Face eager does).
        sliding_window: when given, query position ``p`` sees keys at positions ``> p - sliding_window``.
        softcap: when given, scores become ``softcap * tanh(scores / softcap)`` (after scaling).
        sinks: when given, ``[num_heads]`` attention-sink logits (gpt-oss): each head's softmax gets one more term,
            ``exp(sinks[h])``, in its denominator (a key that every query sees and whose value is zero), so a head
            may attend to "nothing". Compared in float32.
        k_scale, v_scale: the layer's fp8 KV-cache scales: a cached element reads as ``element * scale`` (1.0, and
            ignored, for float caches; see :mod:`vllite.kernels.kv_cache_dtype`).
        plan: the step's CPU plan from :func:`vllite.kernels.plan_paged_attention` for the same metadata and
            ``sliding_window`` (the CPU path builds one itself when it is ``None``); other paths ignore it.
    """

    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    _: KW_ONLY
    max_query_len: int
    max_seq_len: int
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: Tensor | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    plan: CpuAttentionPlan | None = None

    @property
    def num_seqs(self) -> int:
        """The number of sequences in the batch."""
        return self.seq_lens.shape[0]


def gqa_group(query: Tensor, key_cache: Tensor) -> int:
    """Query heads per KV head of ``query`` ``[num_tokens, num_heads, head_dim]`` over ``key_cache``
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; raises ``ValueError`` when it is not a whole number. (The
    value cache may have another head size than the keys, as multi-head latent attention has: the output rows then
    have the values' head size.)"""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return num_heads // num_kv_heads
