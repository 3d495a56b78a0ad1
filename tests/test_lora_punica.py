"""Batched LoRA ops: the torch formulations vs per-token loops, the Triton kernels vs the torch references.

Triton runs under ``TRITON_INTERPRET=1`` on the CPU (set by conftest) with tiny shapes, as in test_kernels.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from vllite.plugins.transformers_executor.lora.punica import (
    SlotSegments,
    embedding_shrink,
    expand_masked_,
    lora_expand,
    lora_shrink,
    shrink_embedding_masked,
    shrink_masked,
    slot_mask,
)

triton_cpu = pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="interpreter tests run on CPU-only machines with triton installed",
)


def case(num_tokens: int, num_slots: int, rank: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``x [T, k]``, ``a_stack [L, R, k]``, ``b_stack [L, n, R]`` (a strided view, as the layers pass it) and
    ``token_slots [T]`` with base tokens and (for L ≥ 3) an unused slot."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g)
    a_stack = torch.randn(num_slots, rank, k, generator=g)
    b_stack = torch.randn(n, num_slots, rank, generator=g).permute(1, 0, 2)
    choices = torch.tensor([-1, *range(num_slots)][: max(2, num_slots)])  # the last slot stays empty for L >= 3
    slots = choices[torch.randint(0, len(choices), (num_tokens,), generator=g)]
    return x, a_stack, b_stack, slots


def naive_delta(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    rows = [
        b_stack[s] @ (a_stack[s] @ x[t]) if s >= 0 else torch.zeros(b_stack.shape[1])
        for t, s in enumerate(slots.tolist())
    ]
    return torch.stack(rows)


def test_masked_formulation_matches_a_per_token_loop() -> None:
    x, a_stack, b_stack, slots = case(11, 3, 4, 10, 6)
    mask = slot_mask(slots, 3, 4, torch.float32)
    assert mask.shape == (11, 12) and torch.equal(mask.view(11, 3, 4).amax(-1).sum(-1), (slots >= 0).float())
    y = torch.zeros(11, 6)
    h = shrink_masked(x, a_stack.reshape(12, 10), mask)
    expand_masked_(y, h, b_stack.permute(1, 0, 2).reshape(6, 12))
    torch.testing.assert_close(y, naive_delta(x, a_stack, b_stack, slots), atol=1e-5, rtol=1e-5)
    assert not y[slots < 0].any()  # base tokens get an exact zero


def test_masked_expand_into_another_dtype() -> None:
    x, a_stack, b_stack, slots = case(5, 2, 4, 8, 6)
    h = shrink_masked(x, a_stack.reshape(8, 8), slot_mask(slots, 2, 4, torch.float32))
    y = torch.zeros(5, 6, dtype=torch.bfloat16)
    expand_masked_(y, h, b_stack.permute(1, 0, 2).reshape(6, 8))
    torch.testing.assert_close(y, naive_delta(x, a_stack, b_stack, slots).bfloat16())


def test_per_token_shrink_and_expand_match_a_loop() -> None:
    x, a_stack, b_stack, slots = case(9, 3, 5, 7, 4)
    h = lora_shrink(x, a_stack, slots)
    for t, s in enumerate(slots.tolist()):
        torch.testing.assert_close(h[t], a_stack[s] @ x[t] if s >= 0 else torch.zeros(5), atol=1e-5, rtol=1e-5)
    y = torch.ones(9, 4)
    lora_expand(y, h, b_stack, slots)
    torch.testing.assert_close(y, 1 + naive_delta(x, a_stack, b_stack, slots), atol=1e-5, rtol=1e-5)


def test_embedding_shrink_both_forms() -> None:
    g = torch.Generator().manual_seed(1)
    a_vocab = torch.randn(20, 3, 4, generator=g)  # [vocab, L, R]
    ids = torch.tensor([3, 19, 0, 3, 7])
    slots = torch.tensor([0, 2, -1, 1, 2])
    h = embedding_shrink(ids, a_vocab, slots)
    expected = torch.stack([a_vocab[i, s] if s >= 0 else torch.zeros(4) for i, s in zip(ids.tolist(), slots.tolist())])
    assert torch.equal(h, expected)
    masked = shrink_embedding_masked(ids, a_vocab.reshape(20, 12), slot_mask(slots, 3, 4, torch.float32))
    assert torch.equal(masked.view(5, 3, 4).sum(1), expected)


def test_slot_segments_group_tokens_by_slot() -> None:
    slots = torch.tensor([2, -1, 0, 2, -1, 0, 2])
    seg = SlotSegments.from_token_slots(slots, 4)
    assert seg.counts.tolist() == [2, 0, 3, 0] and seg.starts.tolist() == [2, 4, 4, 7]
    assert seg.sorted_tokens.tolist() == [1, 4, 2, 5, 0, 3, 6] and seg.num_tokens == 7
    assert seg.sorted_tokens.dtype == seg.starts.dtype == seg.counts.dtype == torch.int32


@triton_cpu
@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "rank", "k", "n"),
    [
        (21, 3, 8, 40, 70),  # several token blocks, K and N not multiples of the tiles, an empty slot
        (3, 1, 1, 16, 16),  # rank 1 (padded to the 16-wide tile), decode-sized
        (40, 4, 16, 130, 33),  # a slot's segment spans token blocks, K spans three 64-wide tiles
    ],
)
def test_triton_kernels_match_the_torch_reference(num_tokens: int, num_slots: int, rank: int, k: int, n: int) -> None:
    from vllite.plugins.transformers_executor.lora.punica_triton import lora_expand_triton, lora_shrink_triton

    x, a_stack, b_stack, slots = case(num_tokens, num_slots, rank, k, n)
    seg = SlotSegments.from_token_slots(slots, num_slots)
    h_ref = lora_shrink(x, a_stack, slots)
    h = lora_shrink_triton(x, a_stack, seg)
    torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-5)
    y_ref = torch.randn(num_tokens, n, generator=torch.Generator().manual_seed(9))
    y = y_ref.clone()
    lora_expand(y_ref, h_ref, b_stack, slots)
    lora_expand_triton(y, h_ref, b_stack, seg)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-5)


@triton_cpu
def test_triton_kernels_half_precision_and_all_base_tokens() -> None:
    from vllite.plugins.transformers_executor.lora.punica_triton import lora_expand_triton, lora_shrink_triton

    x, a_stack, b_stack, slots = case(10, 2, 4, 24, 20)
    x, a_stack, b_stack = x.half(), a_stack.half(), b_stack.half()
    seg = SlotSegments.from_token_slots(slots, 2)
    h = lora_shrink_triton(x, a_stack, seg)
    torch.testing.assert_close(h, lora_shrink(x, a_stack, slots), atol=2e-2, rtol=1e-2)
    y, y_ref = torch.zeros(10, 20, dtype=torch.half), torch.zeros(10, 20, dtype=torch.half)
    lora_expand_triton(y, h, b_stack, seg)
    lora_expand(y_ref, h, b_stack, slots)
    torch.testing.assert_close(y, y_ref, atol=5e-2, rtol=1e-2)
    base = torch.full((10,), -1)
    base_seg = SlotSegments.from_token_slots(base, 2)
    assert not lora_shrink_triton(x, a_stack, base_seg).any()
    y = torch.ones(10, 20, dtype=torch.half)
    lora_expand_triton(y, h, b_stack, base_seg)
    assert torch.equal(y, torch.ones(10, 20, dtype=torch.half))
