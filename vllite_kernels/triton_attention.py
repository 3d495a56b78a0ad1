"""Triton kernels: paged KV-cache write and paged (flash-style) attention over a mixed prefill + decode batch.

Importing this module imports triton; :mod:`vllite.kernels` imports it only when the Triton path is used.
Shapes and semantics are those of :mod:`vllite.kernels.reference`, which these kernels are tested against. Keys and
values may have different head sizes (multi-head latent attention: ``head_dim_k`` for queries and keys,
``head_dim_v`` for values and the output), and a layer may have attention sinks (one logit per query head whose
``exp`` joins each softmax denominator).

Attention grid: ``(num_q_blocks, num_kv_heads)``. One program handles ``BLOCK_Q`` query tokens of one
sequence times the ``GROUP = num_heads // num_kv_heads`` query heads that share one KV head, packed into
``BLOCK_M = BLOCK_Q * GROUP`` (padded to a power of two) rows, so GQA loads each K/V tile once per group.
The flat first grid axis covers every sequence's query blocks without per-sequence padding: sequence ``s``
owns program ids ``[query_start_loc[s] // BLOCK_Q + s, query_start_loc[s + 1] // BLOCK_Q + s + 1)``, found by
binary search, and programs past the end of their sequence's queries exit at once. Each program loops over
its sequence's keys in ``TILE_N`` tiles with an online softmax, looking up each key position's physical
block through the block table, so any block size works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from vllite.kernels.params import PagedAttentionParams, gqa_group

__all__ = ["paged_attention_triton", "reshape_and_cache_triton"]


@triton.jit
def _cache_token(
    src_ptr, dst_ptr, token, block, offset,
    stride_t, stride_h, stride_d,  # source rows [num_tokens, num_kv_heads, head_dim]
    stride_cb, stride_co, stride_ch, stride_cd,  # cache [num_blocks, block_size, num_kv_heads, head_dim]
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """Copy token ``token``'s ``[num_kv_heads, head_dim]`` row into the cache slot ``(block, offset)``, cast to the
    cache's dtype."""
    idx = tl.arange(0, TILE)
    head = idx // HEAD_DIM
    dim = idx % HEAD_DIM
    mask = idx < NUM_KV_HEADS * HEAD_DIM
    x = tl.load(src_ptr + token * stride_t + head * stride_h + dim * stride_d, mask=mask)
    dst = dst_ptr + block * stride_cb + offset * stride_co + head * stride_ch + dim * stride_cd
    tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,  # key [num_tokens, num_kv_heads, head_dim_k]
    stride_vt, stride_vh, stride_vd,  # value [num_tokens, num_kv_heads, head_dim_v]
    stride_kcb, stride_kco, stride_kch, stride_kcd,  # key cache [num_blocks, block_size, num_kv_heads, head_dim_k]
    stride_vcb, stride_vco, stride_vch, stride_vcd,  # value cache [num_blocks, block_size, num_kv_heads, head_dim_v]
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM_K: tl.constexpr, HEAD_DIM_V: tl.constexpr, TILE_K: tl.constexpr, TILE_V: tl.constexpr,
):  # fmt: skip
    """One program per token: write its key and value rows at ``slot_mapping[token]`` (skipped when negative)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _cache_token(
        key_ptr, key_cache_ptr, token, block, offset, stride_kt, stride_kh, stride_kd,
        stride_kcb, stride_kco, stride_kch, stride_kcd, NUM_KV_HEADS, HEAD_DIM_K, TILE_K,
    )  # fmt: skip
    _cache_token(
        value_ptr, value_cache_ptr, token, block, offset, stride_vt, stride_vh, stride_vd,
        stride_vcb, stride_vco, stride_vch, stride_vcd, NUM_KV_HEADS, HEAD_DIM_V, TILE_V,
    )  # fmt: skip


def reshape_and_cache_triton(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Triton twin of :func:`vllite.kernels.reference.reshape_and_cache_ref` (same shapes and promises).

    ``key`` ``[num_tokens, num_kv_heads, head_dim_k]`` and ``value`` ``[num_tokens, num_kv_heads, head_dim_v]`` are
    written in place into the caches ``[num_blocks, block_size, num_kv_heads, head_dim_k]`` (and ``head_dim_v`` for
    values; the two head sizes may differ) at ``slot_mapping`` ``[num_tokens]``; slot ``-1`` skips the token. One
    program per token; all tensors on the same device, any strides. Raises ``ValueError`` on mismatched shapes.
    """
    num_tokens, num_kv_heads, head_dim_k = key.shape
    head_dim_v = value.shape[2]
    if (
        value.shape[:2] != key.shape[:2]
        or key_cache.shape[2:] != key.shape[1:]
        or value_cache.shape[2:] != value.shape[1:]
        or value_cache.shape[:2] != key_cache.shape[:2]
    ):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit the caches "
            f"{tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
        )
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        BLOCK_SIZE=key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM_K=head_dim_k,
        HEAD_DIM_V=head_dim_v,
        TILE_K=triton.next_power_of_2(num_kv_heads * head_dim_k),
        TILE_V=triton.next_power_of_2(num_kv_heads * head_dim_v),
    )


@triton.jit
def _find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest ``s`` with ``query_start_loc[s] // BLOCK_Q + s <= q_block_id`` (binary search)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _window_start(first_pos, sliding_window, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """``(kv_start, kv_lo)`` for query rows from position ``first_pos`` on: keys before ``kv_lo`` are outside every
    row's window, and the key loop starts at ``kv_start``, the tile that holds ``kv_lo`` (both 0 without a window)."""
    kv_start = 0
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(first_pos - sliding_window + 1, 0)
        kv_start = (kv_lo // TILE_N) * TILE_N
    return kv_start, kv_lo


@triton.jit
def _softmax_start(sinks_ptr, head, stride_s, BLOCK_M: tl.constexpr, USE_SINKS: tl.constexpr):
    """``(m_i, l_i)``, each row's running max and sum before its first key: ``-inf`` and 0, or with sinks the row's
    head's sink logit and ``exp(sink - sink) = 1``: the sink is a key every row sees whose value is zero, so the
    accumulator starts at zero either way."""
    if USE_SINKS:
        m_i = tl.load(sinks_ptr + head * stride_s).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _tile_qk(q, k_head, blk, in_blk, offs_d, n_ok, d_ok, stride_kb, stride_ko, stride_kd, IS_FP32: tl.constexpr):
    """``q @ k`` ``[BLOCK_M, TILE_N]``, unscaled and unmasked, for one tile of keys whose cache slots are ``blk``
    (physical block) and ``in_blk`` (offset in it)."""
    k = tl.load(
        k_head + blk[None, :] * stride_kb + in_blk[None, :] * stride_ko + offs_d[:, None] * stride_kd,
        mask=d_ok[:, None] & n_ok[None, :],
        other=0.0,
    )
    if IS_FP32:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    return s


@triton.jit
def _soft_cap(s, softcap, USE_SOFTCAP: tl.constexpr):
    """``softcap * tanh(s / softcap)`` when ``USE_SOFTCAP``, else ``s``."""
    if USE_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1), saturating correctly at +-inf.
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0))
    return s


@triton.jit
def _visible(row_ok, n_ok, offs_n, q_pos, sliding_window, USE_WINDOW: tl.constexpr):
    """Which keys of the tile each query row sees: its own and earlier positions, within the window if any."""
    ok = row_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        ok = ok & (offs_n[None, :] > q_pos[:, None] - sliding_window)
    return ok


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One tile's online-softmax step over masked scores ``s``: ``(p, alpha, l_new, m_new)``, the tile's float32
    numerators, the factor that rescales the previous sum and accumulator, and the new running sum and max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _tile_pv(p, v_head, blk, in_blk, offs_d, n_ok, d_ok, stride_vb, stride_vo, stride_vd, IS_FP32: tl.constexpr):
    """``p @ v`` for one tile of values: ``p`` ``[BLOCK_M, TILE_N]`` the tile's float32 softmax numerators."""
    v = tl.load(
        v_head + blk[:, None] * stride_vb + in_blk[:, None] * stride_vo + offs_d[None, :] * stride_vd,
        mask=n_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if IS_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return pv


# The 41 parameters are grouped by tensor (hence fmt: skip); one per line they would be half the kernel's length.
@triton.jit(do_not_specialize=["num_seqs"])  # a new batch size must not compile a new kernel
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, num_seqs,
    scale, softcap, sliding_window,
    stride_qt, stride_qh, stride_qd,  # query [num_tokens, num_heads, head_dim_k]
    stride_ot, stride_oh, stride_od,  # out [num_tokens, num_heads, head_dim_v]
    stride_kb, stride_ko, stride_kh, stride_kd,  # key cache [num_blocks, block_size, num_kv_heads, head_dim_k]
    stride_vb, stride_vo, stride_vh, stride_vd,  # value cache [num_blocks, block_size, num_kv_heads, head_dim_v]
    stride_bt, stride_s,  # block tables [num_seqs, max_blocks_per_seq], sinks [num_heads]
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM_K: tl.constexpr, HEAD_PAD_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HEAD_PAD_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr,
    IS_FP32: tl.constexpr,
):  # fmt: skip
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, HEAD_PAD_K)
    offs_dv = tl.arange(0, HEAD_PAD_V)
    tok = q_block * BLOCK_Q + offs_m // GROUP  # query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP  # every row's query head, in range even on padding rows
    row_ok = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    dk_ok = offs_dk < HEAD_DIM_K
    dv_ok = offs_dv < HEAD_DIM_V
    q_pos = ctx_len + tok

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_dk[None, :] * stride_qd,
        mask=row_ok[:, None] & dk_ok[None, :],
        other=0.0,
    )

    m_i, l_i = _softmax_start(sinks_ptr, head, stride_s, BLOCK_M, USE_SINKS)
    acc = tl.zeros([BLOCK_M, HEAD_PAD_V], dtype=tl.float32)

    # Keys this block needs: [kv_start, kv_end). kv_end stops at the last query row's own position.
    kv_end = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    # With a window, keys before the block's first row's window (kv_lo) are hidden from every row, and may sit in
    # blocks the KV-cache manager swapped for the null block: they are not loaded (a zero weight times NaN is NaN).
    kv_start, kv_lo = _window_start(ctx_len + q_block * BLOCK_Q, sliding_window, TILE_N, USE_WINDOW)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh

    for start in range(kv_start, kv_end, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_ok = (offs_n < kv_end) & (offs_n >= kv_lo)
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_blk = offs_n % BLOCK_SIZE
        s = _tile_qk(q, k_head, blk, in_blk, offs_dk, n_ok, dk_ok, stride_kb, stride_ko, stride_kd, IS_FP32) * scale
        s = _soft_cap(s, softcap, USE_SOFTCAP)
        s = tl.where(_visible(row_ok, n_ok, offs_n, q_pos, sliding_window, USE_WINDOW), s, float("-inf"))
        p, alpha, l_i, m_i = _online_softmax(s, m_i, l_i)
        pv = _tile_pv(p, v_head, blk, in_blk, offs_dv, n_ok, dv_ok, stride_vb, stride_vo, stride_vd, IS_FP32)
        acc = acc * alpha[:, None] + pv

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dv_ok[None, :],
    )


def paged_attention_triton(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, params: PagedAttentionParams, *, out: Tensor | None = None
) -> Tensor:
    """Triton twin of :func:`vllite.kernels.reference.paged_attention_ref` (same arguments and promises).

    ``query`` ``[num_tokens, num_heads, head_dim_k]`` packed; caches ``[num_blocks, block_size, num_kv_heads,
    head_dim_k]`` (keys) and ``[..., head_dim_v]`` (values; the head sizes may differ); ``params.block_tables``
    ``[num_seqs, max_blocks_per_seq]`` int32; ``params.seq_lens`` ``[num_seqs]`` int32 (including this step's
    tokens); ``params.query_start_loc`` ``[num_seqs + 1]`` int32; ``params.sinks``, when given, ``[num_heads]`` on
    ``query``'s device (any float dtype, read as float32). Returns (or fills ``out``) ``[num_tokens, num_heads,
    head_dim_v]`` in ``query``'s dtype; rows past ``query_start_loc[-1]`` are not written. Scores and softmax
    accumulate in float32 (float32 inputs use exact IEEE dot products). Launches without a host sync:
    ``max_query_len`` only picks the tile shape. Raises ``ValueError`` on mismatched shapes.
    """
    group = gqa_group(query, key_cache)
    num_tokens, num_heads, head_dim_k = query.shape
    head_dim_v, sinks = value_cache.shape[3], params.sinks
    if out is None:
        out = query.new_empty((num_tokens, num_heads, head_dim_v))
    if out.shape[1:] != (num_heads, head_dim_v) or (sinks is not None and sinks.shape != (num_heads,)):
        raise ValueError(
            f"out {tuple(out.shape)} or sinks {None if sinks is None else tuple(sinks.shape)} do not fit "
            f"{num_heads} heads of values of size {head_dim_v}"
        )
    num_seqs = params.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out

    _, block_size, num_kv_heads, _ = key_cache.shape
    sliding_window, softcap = params.sliding_window, params.softcap
    block_m = max(16 if params.max_query_len <= 1 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    tile_n = min(64, max(16, triton.next_power_of_2(params.max_seq_len)))
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        sinks if sinks is not None else query,  # never read without sinks
        params.block_tables,
        params.seq_lens,
        params.query_start_loc,
        num_seqs,
        float(params.scale),
        float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
        *query.stride(),
        *out.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        params.block_tables.stride(0),
        sinks.stride(0) if sinks is not None else 0,
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM_K=head_dim_k,
        HEAD_PAD_K=max(16, triton.next_power_of_2(head_dim_k)),
        HEAD_DIM_V=head_dim_v,
        HEAD_PAD_V=max(16, triton.next_power_of_2(head_dim_v)),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=sliding_window is not None,
        USE_SINKS=sinks is not None,
        IS_FP32=query.dtype == torch.float32,
        num_warps=4,
    )
    return out
