"""Triton kernel of :func:`vllite.kernels.varlen_attention`: flash-style attention over a packed batch, no cache.

Importing this module imports triton; :mod:`vllite.kernels.varlen_attention` imports it only for CUDA tensors.

Grid: ``(num_seqs, num_heads, cdiv(max_seqlen, BLOCK_M))``, sequences on the axis without the 65535 limit. One
program takes ``BLOCK_M`` query rows of one head of one sequence (programs past the end of their sequence exit at
once), loops over that sequence's keys in ``BLOCK_N`` tiles with an online softmax in float32, and reads its KV
head ``head // (num_heads // num_kv_heads)`` (grouped-query attention). ``CAUSAL`` is a compile-time flag: causal
programs stop at their last row's own position and mask the keys after each row. The host never reads ``cu_seqlens``
(no device sync): ``max_seqlen`` only sizes the grid and the tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["varlen_attention_triton"]


@triton.jit
def _tile_scores(
    q,
    k_head,
    kv_rows,
    offs_n,
    offs_m,
    offs_d,
    n_ok,
    d_ok,
    qk_scale,
    stride_kt,
    stride_kd,
    CAUSAL: tl.constexpr,
    IS_FP32: tl.constexpr,
):
    """The scores ``[BLOCK_M, BLOCK_N]`` of the query rows against one tile of keys, ``-inf`` where hidden."""
    k = tl.load(
        k_head + kv_rows[None, :] * stride_kt + offs_d[:, None] * stride_kd,
        mask=d_ok[:, None] & n_ok[None, :],
        other=0.0,
    )
    if IS_FP32:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    # Scores in log2 units (qk_scale carries log2(e)), so the softmax uses exp2.
    s = s * qk_scale
    ok = n_ok[None, :]
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None])
    s = tl.where(ok, s, float("-inf"))
    return s


@triton.jit
def _tile_values(p, v_head, kv_rows, offs_d, n_ok, d_ok, stride_vt, stride_vd, IS_FP32: tl.constexpr):
    """``p @ v`` for one tile of values: ``p`` ``[BLOCK_M, BLOCK_N]`` the tile's float32 softmax numerators."""
    v = tl.load(
        v_head + kv_rows[:, None] * stride_vt + offs_d[None, :] * stride_vd,
        mask=n_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if IS_FP32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return pv


@triton.jit
def _varlen_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_block = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - start
    if q_block * BLOCK_M >= seq_len:
        return
    kv_head = head // GROUP

    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    offs_d = tl.arange(0, HEAD_PAD)
    m_ok = offs_m < seq_len
    d_ok = offs_d < HEAD_DIM
    q_rows = (start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    kv_end = seq_len
    if CAUSAL:
        kv_end = tl.minimum((q_block + 1) * BLOCK_M, seq_len)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        kv_rows = (start + offs_n).to(tl.int64)
        s = _tile_scores(
            q, k_head, kv_rows, offs_n, offs_m, offs_d, n_ok, d_ok, qk_scale, stride_kt, stride_kd, CAUSAL, IS_FP32
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Every row sees key 0 in the first tile, so this only guards against exp2(-inf - -inf) = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)

        pv = _tile_values(p, v_head, kv_rows, offs_d, n_ok, d_ok, stride_vt, stride_vd, IS_FP32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


def varlen_attention_triton(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    scale: float,
    causal: bool = False,
) -> Tensor:
    """The Triton path of :func:`vllite.kernels.varlen_attention` (same arguments and promises).

    Inputs on one device, any strides; ``max_seqlen`` must bound every sequence's length (it sizes the grid, so a
    smaller value leaves rows unwritten). Float32 inputs use exact IEEE dot products; scores, the softmax and the
    output accumulate in float32 for every dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = cu_seqlens.shape[0] - 1
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs <= 0 or max_seqlen <= 0:
        return out
    block_m = 16 if max_seqlen <= 16 else 64
    block_n = min(64, max(16, triton.next_power_of_2(max_seqlen)))
    log2e = 1.4426950408889634
    grid = (num_seqs, num_heads, triton.cdiv(max_seqlen, block_m))
    _varlen_attention_kernel[grid](
        query,
        key,
        value,
        out,
        cu_seqlens,
        float(scale) * log2e,
        *query.stride(),
        *key.stride(),
        *value.stride(),
        *out.stride(),
        GROUP=num_heads // key.shape[1],
        HEAD_DIM=head_dim,
        HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        IS_FP32=query.dtype == torch.float32,
        num_warps=4,
    )
    return out
