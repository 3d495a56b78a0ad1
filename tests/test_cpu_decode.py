"""The compiled CPU decode-attention kernel (``vllite.kernels.cpu_decode``) against the torch reference: contexts
of 1 to 300 tokens in shuffled blocks, GQA groups 1 to 8, odd block sizes and head sizes, through
``paged_attention_cpu`` (which sends pure decode batches to it) and with ``out``; it builds wherever a C++ compiler
is found, and ``VLLITE_CPU_DECODE_KERNEL=0`` turns it off."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernel_support import assert_kernel_builds, kernel_switch
from vllite.kernels import PagedAttentionParams, cpu_decode
from vllite.kernels.cpu_attention import paged_attention_cpu
from vllite.kernels.reference import paged_attention_ref


def _decode_case(num_seqs: int, heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(1, 300) for _ in range(num_seqs)]
    per_seq = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(num_seqs, max(per_seq), dtype=torch.int32)
    used = 0
    for s, count in enumerate(per_seq):
        tables[s, :count] = order[used : used + count].to(torch.int32)
        used += count
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32), torch.arange(num_seqs + 1, dtype=torch.int32)


def test_the_kernel_builds_where_a_compiler_is_found(monkeypatch):
    assert_kernel_builds(monkeypatch, cpu_decode.decode_kernel, "VLLITE_CPU_DECODE_KERNEL")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (4, 4, 16, 16),
        (8, 4, 64, 16),
        (8, 2, 48, 5),
        (8, 1, 32, 4),
        (6, 3, 80, 16),
        (4, 2, 128, 16),
        (8, 4, 64, 20),
        (4, 2, 48, 16),
    ],
)
@pytest.mark.parametrize("num_seqs", [17, 2])
def test_decode_kernel_equals_the_reference(heads, kv_heads, head_dim, block_size, num_seqs):
    """Head sizes that are multiples of 16 take the vectorised path where the CPU has AVX-512, the others the portable
    one; two sequences are split by KV head across the threads, seventeen are handed out whole, longest first."""
    if cpu_decode.decode_kernel() is None:
        pytest.skip("the kernel could not be built here")
    q, k, v, tables, lens, starts = _decode_case(
        num_seqs, heads, kv_heads, head_dim, block_size, seed=heads + block_size
    )
    scale = head_dim**-0.5
    params = PagedAttentionParams(tables, lens, starts, max_query_len=1, max_seq_len=300, scale=scale)
    expected = paged_attention_ref(q, k, v, params)
    direct = cpu_decode.paged_decode_attention(q, k, v, tables, lens, scale=scale)
    assert direct is not None
    torch.testing.assert_close(direct, expected, rtol=1e-5, atol=1e-5)
    out = torch.full_like(q, float("nan"))
    routed = paged_attention_cpu(q, k, v, params, out=out)
    assert routed is out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"), [(8, 4, 64, 16), (8, 2, 48, 5), (6, 3, 80, 16)]
)
@pytest.mark.parametrize("num_seqs", [17, 2])
def test_bfloat16_cache_equals_the_float32_reference_on_the_same_values(
    heads, kv_heads, head_dim, block_size, num_seqs
):
    """A bfloat16 query and cache (the CPU default on AVX512-BF16/AMX machines): the kernel widens each element as it
    reads it and accumulates in float32, so it matches the float32 reference on the same (rounded) values to within
    the output's one rounding to bfloat16; AVX-512 and portable head sizes both."""
    if cpu_decode.decode_kernel() is None:
        pytest.skip("the kernel could not be built here")
    q, k, v, tables, lens, starts = _decode_case(num_seqs, heads, kv_heads, head_dim, block_size, seed=head_dim)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scale = head_dim**-0.5
    params = PagedAttentionParams(tables, lens, starts, max_query_len=1, max_seq_len=300, scale=scale)
    expected = paged_attention_ref(q.float(), k.float(), v.float(), params)
    direct = cpu_decode.paged_decode_attention(q, k, v, tables, lens, scale=scale)
    assert direct is not None and direct.dtype == torch.bfloat16
    torch.testing.assert_close(direct.float(), expected, rtol=8e-3, atol=1e-3)
    out = torch.full_like(q, float("nan"))
    assert paged_attention_cpu(q, k, v, params, out=out) is out
    torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=1e-3)


def test_switched_off_it_leaves_decode_to_the_torch_path(monkeypatch):
    with kernel_switch(monkeypatch, cpu_decode.decode_kernel, "VLLITE_CPU_DECODE_KERNEL", on=False):
        q, k, v, tables, lens, starts = _decode_case(5, 4, 2, 16, 16, seed=3)
        assert cpu_decode.paged_decode_attention(q, k, v, tables, lens, scale=0.25) is None
        params = PagedAttentionParams(tables, lens, starts, max_query_len=1, max_seq_len=300, scale=0.25)
        expected = paged_attention_ref(q, k, v, params)
        got = paged_attention_cpu(q, k, v, params)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
