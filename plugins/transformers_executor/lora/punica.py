"""Batched LoRA in torch: every token of a step gets its own adapter's delta in one set of ops (the punica idea).

Adapters sit in ``L`` device slots, zero-padded to rank ``R``: ``a_stack`` ``[L, R, in]`` and ``b_stack``
``[L, out, R]`` (the adapter's scaling already folded into B). ``token_slots`` ``[T]`` gives each token's slot,
``-1`` for the base model (no delta). Two formulations, same result:

- per token (:func:`lora_shrink`, :func:`lora_expand`): ``h[t] = A[slot_t] @ x[t]`` ``[T, R]``, then
  ``y[t] += B[slot_t] @ h[t]`` — the contract of the Triton kernels (:mod:`.punica_triton`), which compute only each
  token's own slot;
- masked (:func:`shrink_masked`, :func:`expand_masked_`), the CPU path: ``h = (x @ A_all^T) * mask`` ``[T, L*R]``
  with ``A_all = a_stack.reshape(L*R, in)`` and ``mask`` the token-by-slot one-hot repeated over R (built once per
  step by :func:`slot_mask`), then ``y += h @ B_all^T`` with ``B_all`` ``[out, L*R]``. It multiplies every token by
  every slot (``L`` times the work of the per-token form) yet, being two plain GEMMs, beats gathering per-token
  matrices for bmm on the CPU at every shape measured (e.g. in=out=2048, L=4, R=16: 0.09 vs 0.33 ms for 1 token,
  3.1 vs 108 ms for 256 tokens, one thread).

:class:`SlotSegments` is the per-step grouping of tokens by slot the Triton kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def slot_mask(token_slots: torch.Tensor, num_slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, num_slots * rank]``: 1 in token ``t``'s slot's ``rank`` columns, 0 elsewhere (all 0 for slot -1)."""
    slots = torch.arange(num_slots, device=token_slots.device)
    one_hot = (token_slots[:, None] == slots[None, :]).to(dtype)  # [T, L]
    return one_hot[:, :, None].expand(-1, num_slots, rank).reshape(token_slots.shape[0], num_slots * rank)


def shrink_masked(x: torch.Tensor, a_all: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x @ a_all^T) * mask``: ``x`` ``[T, in]``, ``a_all`` ``[L*R, in]``, ``mask`` from :func:`slot_mask`."""
    h = F.linear(x, a_all)
    return h.mul_(mask)


def shrink_embedding_masked(ids: torch.Tensor, a_all_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The embedding form of :func:`shrink_masked`: rows ``ids`` ``[T]`` of ``a_all_t`` ``[vocab, L*R]``, masked."""
    return F.embedding(ids, a_all_t).mul_(mask)


def expand_masked_(y: torch.Tensor, h: torch.Tensor, b_all: torch.Tensor) -> torch.Tensor:
    """``y += h @ b_all^T`` in place (``y`` ``[T, out]``, ``h`` ``[T, L*R]``, ``b_all`` ``[out, L*R]``), returns
    ``y``; ``h`` and ``b_all`` share a dtype, ``y`` may have another (the sum is then cast to it)."""
    if y.dtype == h.dtype:
        return y.addmm_(h, b_all.t())
    return y.add_(F.linear(h, b_all).to(y.dtype))


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """``h[t] = a_stack[slot_t] @ x[t]`` as float32 ``[T, R]``, zero rows for slot -1 (the reference of
    :func:`~.punica_triton.lora_shrink_triton`)."""
    num_slots, rank, in_features = a_stack.shape
    full = F.linear(x.float(), a_stack.reshape(num_slots * rank, in_features).float())
    rows = torch.arange(x.shape[0], device=x.device)
    picked = full.view(-1, num_slots, rank)[rows, token_slots.clamp(min=0)]
    return picked * (token_slots >= 0)[:, None]


def lora_expand(y: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor) -> None:
    """``y[t] += b_stack[slot_t] @ h[t]`` in place for tokens of slot ≥ 0 (``y`` ``[T, out]``, ``h`` ``[T, R]``,
    ``b_stack`` ``[L, out, R]``), accumulated in float32 (the reference of
    :func:`~.punica_triton.lora_expand_triton`)."""
    num_slots, out_features, rank = b_stack.shape
    placed = h.float()[:, None, :] * (token_slots[:, None] == torch.arange(num_slots, device=h.device))[:, :, None]
    b_all = b_stack.permute(1, 0, 2).reshape(out_features, num_slots * rank).float()
    y += F.linear(placed.reshape(-1, num_slots * rank), b_all).to(y.dtype)


def embedding_shrink(ids: torch.Tensor, a_vocab: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """The per-token shrink of an embedding: ``a_vocab[ids[t], slot_t]`` as float32 ``[T, R]`` (zero for slot -1),
    ``a_vocab`` being the stacked A matrices laid out ``[vocab, L, R]``."""
    picked = a_vocab[ids, token_slots.clamp(min=0)].float()
    return picked * (token_slots >= 0)[:, None]


@dataclass(frozen=True)
class SlotSegments:
    """A step's tokens grouped by slot: ``sorted_tokens`` ``[T]`` (token indices, slot -1 first, then slot 0,
    1, ...), and per slot ``starts`` / ``counts`` ``[L]`` into it. int32, on the tokens' device."""

    sorted_tokens: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    num_tokens: int

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor, num_slots: int) -> SlotSegments:
        """Groups ``token_slots`` (``[T]``, values in ``-1 .. num_slots - 1``) with a stable sort, no host sync."""
        order = torch.sort(token_slots, stable=True).indices
        counts = torch.bincount(token_slots + 1, minlength=num_slots + 1)
        starts = torch.cumsum(counts, 0) - counts
        return cls(
            sorted_tokens=order.to(torch.int32),
            starts=starts[1:].to(torch.int32).contiguous(),
            counts=counts[1:].to(torch.int32).contiguous(),
            num_tokens=int(token_slots.shape[0]),
        )
