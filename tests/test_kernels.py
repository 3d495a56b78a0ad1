"""Paged KV-cache kernels: torch references vs from-scratch oracles, Triton kernels vs the references.

Triton runs under ``TRITON_INTERPRET=1`` on the CPU (set by conftest) with tiny shapes; the ``cuda`` tests
run the compiled kernels in half precision when a GPU is present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from vllite.kernels import PagedAttentionParams, is_triton_available, paged_attention, reshape_and_cache
from vllite.kernels.reference import paged_attention_ref, reshape_and_cache_ref

# --------------------------------------------------------------------------------------------- fixtures


@dataclass
class PagedCase:
    """A batch laid out in a paged cache, plus each sequence's dense K/V and queries for the oracle."""

    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S+1] int32
    dense_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    dense_v: list[torch.Tensor]
    max_query_len: int
    max_seq_len: int

    def params(self, **layer: Any) -> PagedAttentionParams:
        """The batch's kernel arguments with the layer settings ``layer`` (``scale``, ``sliding_window``, ...)."""
        return PagedAttentionParams(
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            **layer,
        )

    def args(self, **layer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionParams]:
        """``(query, key_cache, value_cache, params)``: the positional arguments of every attention kernel."""
        return self.query, self.key_cache, self.value_cache, self.params(**layer)


def make_case(
    specs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    extra_tokens: int = 0,
    head_dim_v: int | None = None,
    spare: float | None = None,
) -> PagedCase:
    """``specs`` holds ``(context_len, query_len)`` per sequence; blocks are assigned in shuffled order.

    Unused block-table entries hold an out-of-range id, which the kernels must never read.
    ``extra_tokens`` appends padding query rows past ``query_start_loc[-1]``. ``head_dim_v``: the values' head size
    when it is not the keys' (multi-head latent attention). ``spare``: the value every cache slot that holds no token
    is filled with (``nan`` catches a kernel that reads one; default: random values).
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in specs]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.full((len(specs), max_blocks), 10**6, dtype=torch.int32)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim_v, generator=g)
    if spare is not None:
        key_cache.fill_(spare)
        value_cache.fill_(spare)
    dense_k, dense_v, queries = [], [], []
    for s, ((_ctx, q_len), n) in enumerate(zip(specs, seq_lens)):
        ids = [perm.pop() for _ in range(blocks_per_seq[s])]
        block_tables[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v = torch.randn(n, num_kv_heads, head_dim_v, generator=g)
        pos = torch.arange(n)
        blk = torch.tensor(ids)[pos // block_size]
        key_cache[blk, pos % block_size] = k
        value_cache[blk, pos % block_size] = v
        dense_k.append(k.to(dtype).float())
        dense_v.append(v.to(dtype).float())
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=g))
    queries.append(torch.randn(extra_tokens, num_heads, head_dim, generator=g))
    qsl = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PagedCase(
        query=torch.cat(queries).to(device=device, dtype=dtype),
        key_cache=key_cache.to(device=device, dtype=dtype),
        value_cache=value_cache.to(device=device, dtype=dtype),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device),
        dense_k=dense_k,
        dense_v=dense_v,
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(seq_lens),
    )


def naive_attention(
    case: PagedCase, *, scale: float, sliding_window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Per-sequence, per-head dense causal attention in float64, straight from the definition."""
    query = case.query.double().cpu()
    num_heads = query.shape[1]
    out = torch.zeros_like(query)
    qsl = case.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(case.dense_k, case.dense_v)):
        seq_len = k.shape[0]
        group = num_heads // k.shape[1]
        for t in range(qsl[s], qsl[s + 1]):
            p = seq_len - (qsl[s + 1] - qsl[s]) + (t - qsl[s])
            for h in range(num_heads):
                keys = k[: p + 1, h // group].double()
                vals = v[: p + 1, h // group].double()
                scores = (keys @ query[t, h]) * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                if sliding_window is not None:
                    scores[: max(0, p + 1 - sliding_window)] = float("-inf")
                out[t, h] = torch.softmax(scores, 0) @ vals
    return out


# A decode step with context, a fresh prefill, a chunked prefill over cached context, another decode, a
# decode at position 0 and a prefill ending exactly on a block boundary.
MIXED = [(20, 1), (0, 17), (33, 5), (47, 1), (0, 1), (16, 16)]
TINY = [(5, 1), (0, 7), (9, 4)]  # for the Triton interpreter


# ------------------------------------------------------------------------------------ reshape_and_cache


def expected_caches(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with row ``t`` of ``key`` / ``value`` written at slot ``slots[t]`` (``-1``: nowhere),
    by plain indexing: what a cache write must leave."""
    block_size = key_cache.shape[1]
    expect_k, expect_v = key_cache.clone(), value_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, slot % block_size] = key[t]
            expect_v[slot // block_size, slot % block_size] = value[t]
    return expect_k, expect_v


def test_reshape_and_cache_ref_matches_manual_indexing_and_skips_padding() -> None:
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, hkv, d = 5, 4, 2, 6
    key_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    value_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    key, value = torch.randn(7, hkv, d, generator=g), torch.randn(7, hkv, d, generator=g)
    slots = torch.tensor([13, -1, 0, 19, 6, -1, 7])
    expect_k, expect_v = expected_caches(key_cache, value_cache, key, value, slots)
    original = key_cache.clone()
    reshape_and_cache_ref(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expect_k)
    assert torch.equal(value_cache, expect_v)
    # The padding rows landed nowhere: exactly the 5 real slots changed.
    assert int((key_cache != original).any(-1).any(-1).sum()) == 5


def test_reshape_and_cache_dispatch_casts_to_cache_dtype() -> None:
    key_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    key = torch.full((2, 1, 8), 1.5)
    reshape_and_cache(key, -key, key_cache, value_cache, torch.tensor([5, -1]))
    assert key_cache.dtype == torch.bfloat16
    assert torch.equal(key_cache[1, 1], torch.full((1, 8), 1.5, dtype=torch.bfloat16))
    assert torch.equal(value_cache[1, 1], torch.full((1, 8), -1.5, dtype=torch.bfloat16))
    assert int((key_cache != 0).sum()) == 8


# -------------------------------------------------------------------------------------- paged_attention


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 4, 16, 16), (8, 2, 48, 16), (6, 2, 80, 16), (4, 1, 32, 5)],
)
def test_paged_attention_ref_matches_naive(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    case = make_case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    scale = head_dim**-0.5
    got = paged_attention_ref(*case.args(scale=scale))
    assert got.shape == case.query.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_attention(case, scale=scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("sliding_window", "softcap"), [(8, None), (1, None), (None, 2.0), (6, 1.5)])
def test_paged_attention_ref_window_and_softcap(sliding_window: int | None, softcap: float | None) -> None:
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, seed=3)
    kw = dict(scale=0.7, sliding_window=sliding_window, softcap=softcap)
    got = paged_attention_ref(*case.args(**kw))
    torch.testing.assert_close(got.double(), naive_attention(case, **kw), atol=1e-5, rtol=1e-5)


def test_paged_attention_ref_single_group_and_padding_rows_and_out() -> None:
    # All-prefill batch (one padded group), two padding query rows past query_start_loc[-1], and `out=`.
    case = make_case([(0, 9), (3, 4)], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, extra_tokens=2)
    out = torch.full_like(case.query, 7.0)
    got = paged_attention(*case.args(scale=0.5), out=out)
    assert got is out
    expect = naive_attention(case, scale=0.5)
    torch.testing.assert_close(got[:13].double(), expect[:13], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[13:], torch.full_like(got[13:], 7.0))


def test_paged_attention_ref_matches_hf_eager_attention() -> None:
    """One prefill through the paged path equals transformers' eager attention (the generation oracle)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    case = make_case([(0, 11)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=5)
    q = case.query.transpose(0, 1)[None]  # [1, H, T, D]
    k, v = case.dense_k[0].transpose(0, 1)[None], case.dense_v[0].transpose(0, 1)[None]
    mask = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    module.eval()
    hf, _ = llama.eager_attention_forward(module, q, k, v, mask, scaling=0.25, dropout=0.0)
    got = paged_attention_ref(*case.args(scale=0.25))
    torch.testing.assert_close(got, hf[0], atol=2e-6, rtol=1e-5)


def test_paged_attention_rejects_bad_gqa() -> None:
    case = make_case([(0, 2)], num_heads=3, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_ref(*case.args(scale=1.0))


def test_dispatch_uses_the_variable_length_path_on_cpu() -> None:
    from vllite.kernels.cpu_attention import paged_attention_cpu

    case = make_case(TINY, num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    expect = paged_attention_cpu(*case.args(scale=0.3))
    assert torch.equal(paged_attention(*case.args(scale=0.3)), expect)
    reference = paged_attention_ref(*case.args(scale=0.3))
    torch.testing.assert_close(expect, reference, atol=1e-5, rtol=1e-5)
    assert isinstance(is_triton_available(), bool)


# ------------------------------------------------------------------------ Triton kernels (interpreter)

triton_cpu = pytest.mark.skipif(
    torch.cuda.is_available() or __import__("importlib").util.find_spec("triton") is None,
    reason="interpreter tests run on CPU-only machines with triton installed",
)


@triton_cpu
def test_reshape_and_cache_triton_matches_ref() -> None:
    from vllite.kernels.triton_attention import reshape_and_cache_triton

    g = torch.Generator().manual_seed(2)
    key_cache = torch.randn(3, 4, 3, 5, generator=g)
    value_cache = torch.randn(3, 4, 3, 5, generator=g)
    key, value = torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 5, generator=g)
    slots = torch.tensor([11, -1, 2, 4])
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    reshape_and_cache_triton(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k)
    assert torch.equal(value_cache, ref_v)


@triton_cpu
@pytest.mark.parametrize(
    ("specs", "num_heads", "num_kv_heads", "head_dim", "block_size", "sliding_window", "softcap"),
    [
        (TINY, 2, 1, 16, 4, None, None),  # GQA group 2, several blocks per sequence
        (TINY, 3, 1, 12, 16, None, None),  # group 3 (not a power of two), head_dim padded to 16
        (TINY, 2, 2, 8, 4, 3, 2.0),  # sliding window and softcap
        ([(9, 1), (0, 1), (30, 1)], 4, 2, 8, 4, None, None),  # decode-only launch (16-row tiles)
        ([(3, 19), (0, 1), (10, 9)], 8, 1, 8, 4, None, None),  # BLOCK_Q = 8: a sequence spans 3 q-blocks
    ],
)
def test_paged_attention_triton_interpreter_matches_ref(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    from vllite.kernels.triton_attention import paged_attention_triton

    case = make_case(
        specs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        extra_tokens=1,
    )
    kw = dict(scale=head_dim**-0.5, sliding_window=sliding_window, softcap=softcap)
    expect = paged_attention_ref(*case.args(**kw))
    got = paged_attention_triton(*case.args(**kw), out=torch.zeros_like(case.query))
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- CUDA (compiled)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 5e-5), (torch.float16, 5e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "sliding_window", "softcap"),
    [(32, 8, 128, None, None), (12, 4, 80, None, None), (8, 1, 64, 64, 30.0), (40, 40, 96, None, None)],
)
def test_paged_attention_triton_cuda_matches_ref(
    dtype: torch.dtype,
    atol: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    from vllite.kernels.triton_attention import paged_attention_triton

    specs = [(200, 1), (0, 130), (257, 70), (33, 1), (0, 1), (512, 3), *[(i * 17, 1) for i in range(1, 20)]]
    case = make_case(
        specs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device="cuda",
    )
    kw = dict(scale=head_dim**-0.5, sliding_window=sliding_window, softcap=softcap)
    expect = paged_attention_ref(*case.args(**kw))
    got = paged_attention_triton(*case.args(**kw))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expect.float(), atol=atol, rtol=atol)
    assert torch.equal(paged_attention(*case.args(**kw)), got)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache_triton_cuda_matches_ref(dtype: torch.dtype) -> None:
    from vllite.kernels.triton_attention import reshape_and_cache_triton

    key_cache = torch.randn(64, 16, 8, 80, device="cuda", dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    key = torch.randn(300, 8, 80, device="cuda", dtype=torch.float32)
    value = torch.randn_like(key)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    reshape_and_cache_triton(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)


def test_reference_works_in_and_out_of_inference_mode():
    """The reference reuses gather buffers across calls; they must not become inference-only tensors."""
    torch.manual_seed(0)
    key_cache = torch.randn(8, 4, 2, 8)
    value_cache = torch.randn(8, 4, 2, 8)
    query = torch.randn(3, 4, 8)
    params = PagedAttentionParams(
        torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32),
        torch.tensor([5, 3, 7], dtype=torch.int32),
        torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=7,
        scale=0.35,
    )
    with torch.inference_mode():
        inside = paged_attention_ref(query, key_cache, value_cache, params)
    outside = paged_attention_ref(query, key_cache, value_cache, params)
    torch.testing.assert_close(inside.clone(), outside)
