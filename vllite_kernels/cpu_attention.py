"""CPU paged attention whose cost follows each sequence's own context length.

The batch is attended bucket by bucket (see :mod:`vllite.kernels.cpu_plan`): per layer, the cache blocks of all
buckets are gathered with one ``index_select`` each for keys and values into reused per-thread buffers, the query
rows with one more (skipped when they are already in order), and each bucket runs one
``torch.nn.functional.scaled_dot_product_attention`` on strided views of those buffers (``[n, kv_heads, L, dim]``
read in place, grouped-query heads via ``enable_gqa``, or for decode buckets with groups of 4 or more as extra
query rows of their KV head so keys are read once per KV head), padded only to the bucket's own longest context. Fresh
prefills use ``is_causal`` and no mask; the rest use the plan's additive mask (length, causality within the
query, sliding window). The gathered rows past each sequence's length are zeroed first: a masked position must
contribute nothing even when the cache there holds NaN or Inf (a freed block written by a model that made NaN, memory
never written), and ``0 * NaN`` is NaN. A ``softcap`` (which SDPA cannot apply) takes an explicit float32
matmul-softmax-matmul per bucket instead. The outputs go back to the packed token order with one ``index_select``
into ``out``.

Attention sinks (gpt-oss) take the same explicit path as a softcap: one more term per head in the softmax. Values of
another head size than the keys (multi-head latent attention) go through SDPA as they are.

A pure decode batch (one query token per sequence, a float32, bfloat16 or fp8 cache, no window, softcap or sinks,
keys and values of one head size) skips all that: the compiled kernel of :mod:`vllite.kernels.cpu_decode` reads the
cache through the block tables in place.

An fp8 cache (``--kv-cache-dtype fp8``, see :mod:`vllite.kernels.kv_cache_dtype`) is gathered as bytes and widened to
the query's dtype (times ``params.k_scale`` / ``v_scale``) before SDPA, to float32 by the compiled module's
``widen_fp8`` (torch converts fp8 element by element: 5x slower here); the write saturates ``value / scale`` to fp8.

:func:`~vllite.kernels.reference.paged_attention_ref` is the reference this path is tested against.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from vllite.kernels.cpu_decode import paged_decode_attention, widen_fp8
from vllite.kernels.cpu_plan import AttentionBucket, CacheSlots, CpuAttentionPlan, plan_paged_attention_cpu
from vllite.kernels.kv_cache_dtype import dequantize_kv, is_fp8, quantize_kv
from vllite.kernels.params import PagedAttentionParams, gqa_group

__all__ = ["paged_attention_cpu", "reshape_and_cache_cpu"]

#: GQA group size from which decode buckets fold the group's heads into query rows (measured: faster from 4 on,
#: slower at 2).
FOLD_GROUP_MIN = 4

# Per-thread gather buffers, reused across layers and steps (fresh multi-megabyte tensors cost page faults).
_scratch = threading.local()


def _buffer(slot: int, numel: int, like: Tensor) -> Tensor:
    """A reused flat buffer of at least ``numel`` elements of ``like``'s dtype; valid until ``slot`` is reused."""
    buffers: dict = _scratch.__dict__.setdefault("buffers", {})
    key = (slot, like.dtype, like.device)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        # A normal tensor even when first needed under inference_mode, so it can be written outside it too.
        with torch.inference_mode(False):
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = buffers[key] = torch.empty(size, dtype=like.dtype, device=like.device)
    return buf[:numel]


def reshape_and_cache_cpu(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor | CacheSlots,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """:func:`~vllite.kernels.reference.reshape_and_cache_ref` as one ``index_copy_`` per cache.

    ``slot_mapping`` may also be the step's :class:`~vllite.kernels.cpu_plan.CacheSlots` (a plan's ``slots``:
    the ``-1`` entries dropped once per step rather than per layer). Caches whose ``[num_blocks * block_size]``
    rows are not one flat view are written through the reference. An fp8 cache takes ``key / k_scale`` and
    ``value / v_scale``, saturated, written as bytes (torch has no fp8 ``index_copy_``).
    """
    slots, rows = slot_mapping if isinstance(slot_mapping, CacheSlots) else CacheSlots.of(slot_mapping)
    if rows is not None:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        from vllite.kernels.reference import reshape_and_cache_ref

        reshape_and_cache_ref(key, value, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale)
        return
    num_rows = key_cache.shape[0] * key_cache.shape[1]
    flat_k, flat_v = key_cache.view(num_rows, *key_cache.shape[2:]), value_cache.view(num_rows, *value_cache.shape[2:])
    k, v = quantize_kv(key, key_cache.dtype, k_scale), quantize_kv(value, value_cache.dtype, v_scale)
    if is_fp8(key_cache.dtype):
        flat_k.view(torch.uint8).index_copy_(0, slots, k.view(torch.uint8))
        flat_v.view(torch.uint8).index_copy_(0, slots, v.view(torch.uint8))
        return
    flat_k.index_copy_(0, slots, k)
    flat_v.index_copy_(0, slots, v)


def _zero_stale(keys: Tensor, values: Tensor, rows: Tensor) -> None:
    """Zeroes the gathered token ``rows`` that hold no token of their sequence (the tail of a last block, a bucket's
    padding blocks), whose keys and values the masks hide: a hidden score is ``-inf`` only for a finite key, and a
    zero weight times a NaN or Inf value is NaN. Costs one ``index_fill_`` over those rows per cache and layer."""
    if rows.numel() == 0:
        return
    for gathered in (keys, values):
        flat = gathered.view(-1, *gathered.shape[2:])
        (flat.view(torch.uint8) if flat.element_size() == 1 else flat).index_fill_(0, rows, 0)


def _widened(cache: Tensor, scale: float, out: Tensor) -> Tensor:
    """fp8 ``cache`` times ``scale`` in ``out``'s dtype: the compiled widening for float32, torch's otherwise."""
    if widen_fp8(cache, scale, out):
        return out
    return dequantize_kv(cache, out.dtype, scale, out=out)


def _explicit(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    *,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """Attention as float32 matmul-softmax-matmul, for what SDPA cannot apply: ``softcap * tanh(scores / softcap)``
    and attention sinks (one more softmax term per head). ``q [n, H, Mq, D]``, ``k [n, Hkv, L, D]``,
    ``v [n, Hkv, L, Dv]``; returns ``[n, H, Mq, Dv]``."""
    n, num_heads, q_len, head_dim = q.shape
    num_kv_heads, ctx, v_dim = k.shape[1], k.shape[2], v.shape[3]
    group = num_heads // num_kv_heads
    qg = q.float().reshape(n, num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.view(n, num_kv_heads, group, q_len, ctx).add_(mask.float()[:, :, None])
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(device=q.device, dtype=torch.float32).view(1, num_kv_heads, group, 1, 1)
        probs = torch.softmax(torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1), dim=-1)[..., :ctx]
    probs = probs.reshape(n, num_kv_heads, group * q_len, ctx)
    return torch.matmul(probs, v.float()).view(n, num_heads, q_len, v_dim).to(q.dtype)


def _attend_bucket(
    bucket: AttentionBucket,
    q_rows: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """One bucket's attention; returns ``[num_seqs * q_len, num_heads, value_head_dim]`` rows in bucket order."""
    n, mq, nb = bucket.num_seqs, bucket.q_len, bucket.num_blocks
    _, num_heads, head_dim = q_rows.shape
    block_size, num_kv_heads, v_dim = keys.shape[1], keys.shape[2], values.shape[3]
    ctx = nb * block_size
    q = q_rows[bucket.q_start : bucket.q_start + n * mq].view(n, mq, num_heads, head_dim).transpose(1, 2)
    span = slice(bucket.kv_start, bucket.kv_start + n * nb)
    k = keys[span].view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)
    v = values[span].view(n, ctx, num_kv_heads, v_dim).transpose(1, 2)
    group = num_heads // num_kv_heads
    if softcap is not None or sinks is not None:
        o = _explicit(q, k, v, bucket.mask(torch.float32), scale=scale, softcap=softcap, sinks=sinks)
    elif mq == 1 and group >= FOLD_GROUP_MIN:
        # Decode with wide groups: the group's heads become query rows of their KV head, so each KV head's keys
        # are read once per block rather than once per query head (enable_gqa). All views.
        q = q.reshape(n, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.mask(q.dtype), scale=scale)
        return o.reshape(n, num_heads, v_dim)
    elif bucket.causal:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads)
    else:
        mask = bucket.mask(q.dtype)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
    return o.transpose(1, 2).reshape(n * mq, num_heads, v_dim)


def _plan(query: Tensor, key_cache: Tensor, params: PagedAttentionParams) -> CpuAttentionPlan:
    """``params.plan`` when it was made for ``key_cache``'s block size and ``params.sliding_window``, else a new one."""
    plan, block_size = params.plan, key_cache.shape[1]
    if plan is not None and plan.matches(block_size, params.sliding_window):
        return plan
    return plan_paged_attention_cpu(
        params.block_tables,
        params.seq_lens,
        params.query_start_loc,
        block_size=block_size,
        num_heads=query.shape[1],
        num_kv_heads=key_cache.shape[2],
        head_dim=query.shape[2],
        sliding_window=params.sliding_window,
    )


def paged_attention_cpu(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, params: PagedAttentionParams, *, out: Tensor | None = None
) -> Tensor:
    """Same contract as :func:`~vllite.kernels.reference.paged_attention_ref`, cost proportional to each context.

    ``params.plan`` (from :func:`~vllite.kernels.cpu_plan.plan_paged_attention_cpu` for the same metadata, block
    size and ``sliding_window``) is built here when missing or made for another window; a forward pass builds it
    once and passes it to every layer. ``max_query_len`` only tells a pure decode batch (one token per sequence),
    which the compiled kernel of :mod:`vllite.kernels.cpu_decode` serves when it can.
    """
    gqa_group(query, key_cache)
    num_tokens = query.shape[0]
    decode = params.max_query_len == 1 and num_tokens == params.num_seqs
    same_dims = value_cache.shape[3] == key_cache.shape[3]
    if decode and params.sliding_window is None and params.softcap is None and params.sinks is None and same_dims:
        # Pure decode (one query token per sequence): the compiled kernel reads the cache through the block
        # tables, without gathering the contexts (see vllite.kernels.cpu_decode).
        tables, lens = params.block_tables, params.seq_lens
        result = paged_decode_attention(
            query,
            key_cache,
            value_cache,
            tables,
            lens,
            scale=params.scale,
            k_scale=params.k_scale,
            v_scale=params.v_scale,
            out=out,
        )
        if result is not None:
            return result
    plan = _plan(query, key_cache, params)
    num_valid = plan.num_valid_tokens
    out_shape = (*query.shape[:2], value_cache.shape[3])
    if num_valid == 0:
        return query.new_zeros(out_shape) if out is None else out

    total = plan.block_index.numel()
    row, v_row = key_cache[0].numel(), value_cache[0].numel()
    keys = _buffer(0, total * row, key_cache).view(total, *key_cache.shape[1:])
    values = _buffer(1, total * v_row, value_cache).view(total, *value_cache.shape[1:])
    torch.index_select(key_cache, 0, plan.block_index, out=keys)
    torch.index_select(value_cache, 0, plan.block_index, out=values)
    _zero_stale(keys, values, plan.stale_rows())
    if is_fp8(key_cache.dtype):
        # Widen the gathered bytes once into reused buffers of the query's dtype; SDPA then runs as for that cache.
        keys = _widened(keys, params.k_scale, _buffer(2, total * row, query).view(keys.shape))
        values = _widened(values, params.v_scale, _buffer(3, total * v_row, query).view(values.shape))
    q_rows = query if plan.query_index is None else query.index_select(0, plan.query_index)
    scale, softcap, sinks = params.scale, params.softcap, params.sinks
    outs = [_attend_bucket(b, q_rows, keys, values, scale=scale, softcap=softcap, sinks=sinks) for b in plan.buckets]
    result = outs[0] if len(outs) == 1 else torch.cat(outs)
    if out is None and num_tokens == num_valid:
        if plan.out_index is None:
            return result.to(query.dtype)
        return result.to(query.dtype).index_select(0, plan.out_index)
    if out is None:
        out = query.new_zeros(out_shape)
    if plan.out_index is None:
        out[:num_valid].copy_(result[:num_valid])
    else:
        torch.index_select(result.to(out.dtype), 0, plan.out_index, out=out[:num_valid])
    return out
