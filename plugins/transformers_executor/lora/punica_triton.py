"""Triton kernels for batched LoRA on CUDA: SGMV-style shrink and expand over tokens grouped by adapter slot.

Importing this module imports triton; the LoRA layers import it only when a step runs on CUDA with triton.
The contract is that of :func:`~.punica.lora_shrink` / :func:`~.punica.lora_expand` (tested against them under
``TRITON_INTERPRET=1``). Tokens are grouped by slot once per step (:class:`~.punica.SlotSegments`); program
``(m, ..., slot)`` takes rows ``m * BLOCK_M ...`` of that slot's segment (gathered by token index, so no token is
moved) and exits at once when the segment is shorter, so one launch serves every slot, prefill and decode alike,
with ``tl.dot`` on ``BLOCK_M`` tokens of one adapter at a time. Base-model tokens (slot -1) are in no segment.
Accumulation is float32; float32 inputs multiply in IEEE precision (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllite.plugins.transformers_executor.lora.punica import SlotSegments

__all__ = ["lora_expand_triton", "lora_shrink_triton"]

_BLOCK_M = 16
_BLOCK_K = 64
_BLOCK_N = 64


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    sorted_ptr,
    starts_ptr,
    counts_ptr,
    K,
    R,
    stride_xt,
    stride_xk,
    stride_al,
    stride_ar,
    stride_ak,
    stride_ht,
    stride_hr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tokens = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x_tile = tl.load(
            x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a_tile = tl.load(  # [BLOCK_K, BLOCK_R]: A[slot] transposed
            a_base + offs_k[:, None] * stride_ak + offs_r[None, :] * stride_ar,
            mask=k_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(x_tile, a_tile, input_precision="ieee")
        else:
            acc += tl.dot(x_tile, a_tile)
    h_ptrs = h_ptr + tokens[:, None] * stride_ht + offs_r[None, :] * stride_hr
    tl.store(h_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    sorted_ptr,
    starts_ptr,
    counts_ptr,
    N,
    R,
    stride_ht,
    stride_hr,
    stride_bl,
    stride_bn,
    stride_br,
    stride_yt,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tokens = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    h_tile = tl.load(
        h_ptr + tokens[:, None] * stride_ht + offs_r[None, :] * stride_hr,
        mask=m_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    b_tile = tl.load(  # [BLOCK_R, BLOCK_N]: B[slot] transposed
        b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    h_tile = h_tile.to(b_tile.dtype)
    if IEEE:
        acc = tl.dot(h_tile, b_tile, input_precision="ieee")
    else:
        acc = tl.dot(h_tile, b_tile)
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    y_tile = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_tile.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def lora_shrink_triton(x: torch.Tensor, a_stack: torch.Tensor, segments: SlotSegments) -> torch.Tensor:
    """``h[t] = a_stack[slot_t] @ x[t]`` as float32 ``[T, R]`` (zero rows for base tokens): ``x`` ``[T, in]`` and
    ``a_stack`` ``[L, R, in]`` of one dtype, any strides."""
    num_slots, rank, in_features = a_stack.shape
    num_tokens = x.shape[0]
    h = torch.zeros(num_tokens, rank, device=x.device, dtype=torch.float32)
    if num_tokens == 0:
        return h
    grid = (triton.cdiv(num_tokens, _BLOCK_M), num_slots)
    _sgmv_shrink_kernel[grid](
        x,
        a_stack,
        h,
        segments.sorted_tokens,
        segments.starts,
        segments.counts,
        in_features,
        rank,
        x.stride(0),
        x.stride(1),
        a_stack.stride(0),
        a_stack.stride(1),
        a_stack.stride(2),
        h.stride(0),
        h.stride(1),
        BLOCK_M=_BLOCK_M,
        BLOCK_R=_block_r(rank),
        BLOCK_K=_BLOCK_K,
        IEEE=x.dtype == torch.float32,
    )
    return h


def lora_expand_triton(y: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor, segments: SlotSegments) -> None:
    """``y[t] += b_stack[slot_t] @ h[t]`` in place for tokens of a slot: ``y`` ``[T, out]``, ``h`` ``[T, R]``
    (cast to ``b_stack``'s dtype), ``b_stack`` ``[L, out, R]``, any strides."""
    num_slots, out_features, rank = b_stack.shape
    num_tokens = y.shape[0]
    if num_tokens == 0:
        return
    grid = (triton.cdiv(num_tokens, _BLOCK_M), triton.cdiv(out_features, _BLOCK_N), num_slots)
    _sgmv_expand_kernel[grid](
        h,
        b_stack,
        y,
        segments.sorted_tokens,
        segments.starts,
        segments.counts,
        out_features,
        rank,
        h.stride(0),
        h.stride(1),
        b_stack.stride(0),
        b_stack.stride(1),
        b_stack.stride(2),
        y.stride(0),
        y.stride(1),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_R=_block_r(rank),
        IEEE=b_stack.dtype == torch.float32,
    )
