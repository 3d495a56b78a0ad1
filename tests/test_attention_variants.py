"""Paged-attention variants: attention sinks (gpt-oss) and values whose head size differs from the keys' (multi-head
latent attention, DeepSeek-V3), in the Triton kernels and the torch paths (the reference and the CPU path), against a
from-scratch float64 oracle per sequence.

Triton runs under ``TRITON_INTERPRET=1`` on the CPU (set by conftest) with tiny shapes; the ``cuda`` tests run the
compiled kernels in half precision when a GPU is present.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from tests.test_kernels import PagedCase, expected_caches
from tests.test_kernels import make_case as kernels_make_case

triton_cpu = pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="interpreter tests run on CPU-only machines with triton installed",
)

# A decode with context, a fresh prefill over two blocks, a chunked prefill over cached context and a decode at
# position 0 (it sees one key: only the sink competes with it).
MIXED = [(5, 1), (0, 7), (9, 4), (0, 1)]


def make_case(
    specs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim_k: int,
    head_dim_v: int,
    block_size: int = 4,
    **kwargs: Any,
) -> PagedCase:
    """``tests.test_kernels.make_case`` with keys and values of their own head sizes, every slot that holds no token
    filled with NaN (a kernel that reads one fails) and the unused block-table entries out of range."""
    return kernels_make_case(
        specs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim_k,
        head_dim_v=head_dim_v,
        block_size=block_size,
        spare=float("nan"),
        **kwargs,
    )


def oracle(
    case: PagedCase,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention per sequence in float64, from the definition: scores, softcap, mask, a softmax with one
    appended sink column per head (dropped afterwards), and the weighted sum of the values. ``[T, H, Dv]``; padding
    rows past ``query_start_loc[-1]`` stay zero."""
    query = case.query.double().cpu()
    num_heads = query.shape[1]
    out = torch.zeros(query.shape[0], num_heads, case.dense_v[0].shape[2], dtype=torch.float64)
    qsl = case.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(case.dense_k, case.dense_v)):
        k, v = k.double(), v.double()
        seq_len, group = k.shape[0], num_heads // k.shape[1]
        q = query[qsl[s] : qsl[s + 1]]  # [Q, H, Dk]
        keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [N, H, D*]
        scores = torch.einsum("qhd,nhd->hqn", q, keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        visible = torch.arange(seq_len)[None, :] <= q_pos
        if sliding_window is not None:
            visible &= torch.arange(seq_len)[None, :] > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double().cpu()[:, None, None].expand(num_heads, q.shape[0], 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :seq_len]
        out[qsl[s] : qsl[s + 1]] = torch.einsum("hqn,nhd->qhd", probs, values)
    return out


def sink_logits(num_heads: int, seed: int = 7) -> torch.Tensor:
    """Per-head sink logits spanning the regimes: random ones, one that swamps every score and one that is nil."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))
    sinks[0] = 6.0
    sinks[-1] = -30.0
    return sinks


# ------------------------------------------------------------------------------------------------- sinks


@triton_cpu
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "sliding_window", "softcap", "sinks_dtype"),
    [
        (4, 2, None, None, torch.float32),  # GQA: the two rows of a group read different sinks
        (4, 2, 3, None, torch.float32),  # window
        (4, 2, None, 2.0, torch.float32),  # softcap
        (4, 2, 5, 1.5, torch.bfloat16),  # both, with gpt-oss's bfloat16 sinks
        (3, 1, None, None, torch.float32),  # group 3 (not a power of two)
    ],
)
def test_sinks_match_oracle(
    num_heads: int, num_kv_heads: int, sliding_window: int | None, softcap: float | None, sinks_dtype: torch.dtype
) -> None:
    from vllite.kernels.triton_attention import paged_attention_triton

    case = make_case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim_k=16, head_dim_v=16, seed=1)
    sinks = sink_logits(num_heads).to(sinks_dtype)
    layer = dict(scale=0.25, sliding_window=sliding_window, softcap=softcap)
    got = paged_attention_triton(case.query, case.key_cache, case.value_cache, case.params(**layer, sinks=sinks))
    expect = oracle(case, **layer, sinks=sinks)
    torch.testing.assert_close(got.double(), expect, atol=1e-5, rtol=1e-5)
    # The sinks matter: without them the result is another one.
    plain = paged_attention_triton(case.query, case.key_cache, case.value_cache, case.params(**layer))
    torch.testing.assert_close(plain.double(), oracle(case, **layer), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain, got, atol=1e-3)


@triton_cpu
def test_sinks_decode_only_batch_and_padding_rows_untouched() -> None:
    """A decode-only launch (16-row tiles), a padding row past the last sequence and a given ``out``."""
    from vllite.kernels.triton_attention import paged_attention_triton

    case = make_case([(9, 1), (0, 1), (21, 1)], num_heads=4, num_kv_heads=2, head_dim_k=8, head_dim_v=8, extra_tokens=1)
    sinks = sink_logits(4, seed=3)
    out = torch.full((4, 4, 8), 7.0)
    got = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.params(scale=0.4, sinks=sinks), out=out
    )
    assert got is out
    torch.testing.assert_close(got[:3].double(), oracle(case, scale=0.4, sinks=sinks)[:3], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3], torch.full((4, 8), 7.0))


@triton_cpu
def test_sinks_float16() -> None:
    """Half-precision inputs take the kernel's non-IEEE dot products; scores and softmax stay float32."""
    from vllite.kernels.triton_attention import paged_attention_triton

    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim_k=16, head_dim_v=16, dtype=torch.float16, seed=2)
    sinks = sink_logits(4).to(torch.float16)
    got = paged_attention_triton(case.query, case.key_cache, case.value_cache, case.params(scale=0.25, sinks=sinks))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), oracle(case, scale=0.25, sinks=sinks), atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------- different K and V head sizes


@triton_cpu
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim_k", "head_dim_v", "with_sinks", "sliding_window"),
    [
        (4, 4, 32, 16, False, None),  # DeepSeek-V3's layout in miniature: nope + rope keys, smaller values
        (4, 2, 32, 16, True, None),  # with sinks and GQA
        (4, 2, 24, 8, True, 4),  # both sizes padded (to 32 and 16), with a window
        (2, 1, 16, 32, False, None),  # values larger than keys
    ],
)
def test_value_head_size_differs_from_key_head_size(
    num_heads: int, num_kv_heads: int, head_dim_k: int, head_dim_v: int, with_sinks: bool, sliding_window: int | None
) -> None:
    from vllite.kernels.triton_attention import paged_attention_triton

    case = make_case(
        MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim_k=head_dim_k, head_dim_v=head_dim_v, seed=4
    )
    sinks = sink_logits(num_heads) if with_sinks else None
    layer = dict(scale=head_dim_k**-0.5, sliding_window=sliding_window, sinks=sinks)
    got = paged_attention_triton(case.query, case.key_cache, case.value_cache, case.params(**layer))
    assert got.shape == (case.query.shape[0], num_heads, head_dim_v) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), oracle(case, **layer), atol=1e-5, rtol=1e-5)


@triton_cpu
def test_value_head_size_out_buffer_checked() -> None:
    from vllite.kernels.triton_attention import paged_attention_triton

    case = make_case([(3, 2)], num_heads=2, num_kv_heads=1, head_dim_k=32, head_dim_v=16)
    params = case.params(scale=0.2)
    with pytest.raises(ValueError, match="out"):
        paged_attention_triton(case.query, case.key_cache, case.value_cache, params, out=torch.empty_like(case.query))
    with pytest.raises(ValueError, match="sinks"):
        paged_attention_triton(
            case.query, case.key_cache, case.value_cache, case.params(scale=0.2, sinks=torch.zeros(3))
        )


# ------------------------------------------------------------------------------------------- cache write


@triton_cpu
def test_reshape_and_cache_different_head_sizes() -> None:
    """Keys of 32 and values of 16 per head, read from one strided ``[T, Hkv, 48]`` projection, skipping ``-1``."""
    from vllite.kernels.triton_attention import reshape_and_cache_triton

    g = torch.Generator().manual_seed(5)
    num_blocks, block_size, hkv = 3, 4, 2
    key_cache = torch.randn(num_blocks, block_size, hkv, 32, generator=g)
    value_cache = torch.randn(num_blocks, block_size, hkv, 16, generator=g)
    kv = torch.randn(5, hkv, 48, generator=g)
    key, value = kv[..., :32], kv[..., 32:]
    slots = torch.tensor([11, -1, 2, 4, 0])
    expect_k, expect_v = expected_caches(key_cache, value_cache, key, value, slots)
    reshape_and_cache_triton(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expect_k)
    assert torch.equal(value_cache, expect_v)
    with pytest.raises(ValueError, match="do not fit"):
        reshape_and_cache_triton(key, value, value_cache, key_cache, slots)


@triton_cpu
def test_cache_write_then_attend_with_different_head_sizes() -> None:
    """The two kernels together: a prefill written through the cache-write kernel, then attended with sinks."""
    from vllite.kernels.triton_attention import paged_attention_triton, reshape_and_cache_triton

    case = make_case([(0, 6), (2, 3)], num_heads=4, num_kv_heads=2, head_dim_k=32, head_dim_v=16, seed=6)
    key_cache, value_cache = (
        torch.full_like(case.key_cache, float("nan")),
        torch.full_like(case.value_cache, float("nan")),
    )
    for s, (k, v) in enumerate(zip(case.dense_k, case.dense_v)):
        pos = torch.arange(k.shape[0])
        slots = case.block_tables[s].long()[pos // 4] * 4 + pos % 4
        reshape_and_cache_triton(k.float(), v.float(), key_cache, value_cache, slots)
    sinks = sink_logits(4)
    got = paged_attention_triton(case.query, key_cache, value_cache, case.params(scale=0.2, sinks=sinks))
    torch.testing.assert_close(got.double(), oracle(case, scale=0.2, sinks=sinks), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------- CUDA (compiled)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 5e-5), (torch.float16, 5e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim_k", "head_dim_v", "with_sinks", "sliding_window"),
    [(64, 8, 64, 64, True, 128), (16, 16, 192, 128, False, None), (16, 4, 192, 128, True, None)],
)
def test_variants_cuda_match_oracle(
    dtype: torch.dtype,
    atol: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim_k: int,
    head_dim_v: int,
    with_sinks: bool,
    sliding_window: int | None,
) -> None:
    from vllite.kernels.triton_attention import paged_attention_triton

    specs = [(200, 1), (0, 130), (257, 70), (33, 1), (0, 1), *[(i * 17, 1) for i in range(1, 9)]]
    case = make_case(
        specs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        block_size=16,
        dtype=dtype,
        device="cuda",
    )
    sinks = sink_logits(num_heads).to("cuda") if with_sinks else None
    layer = dict(scale=head_dim_k**-0.5, sliding_window=sliding_window, sinks=sinks)
    got = paged_attention_triton(case.query, case.key_cache, case.value_cache, case.params(**layer))
    assert got.dtype == dtype and got.shape[2] == head_dim_v
    torch.testing.assert_close(got.double().cpu(), oracle(case, **layer), atol=atol, rtol=atol)


# ---------------------------------------------------------------------------------------------- the torch paths
def _torch_backends() -> dict[str, object]:
    from vllite.kernels.cpu_attention import paged_attention_cpu
    from vllite.kernels.reference import paged_attention_ref

    return {"reference": paged_attention_ref, "cpu": paged_attention_cpu}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize(
    ("head_dim_v", "sliding_window", "softcap", "with_sinks"),
    [(16, None, None, True), (16, 6, 30.0, True), (8, None, None, False), (8, 6, None, True)],
)
def test_torch_paths_serve_sinks_and_value_head_sizes(backend, head_dim_v, sliding_window, softcap, with_sinks):
    """The reference and the CPU path (its buckets; the compiled decode kernel steps aside for these variants)
    equal the oracle for sinks and for values narrower than the keys, on a mixed batch with decodes."""
    attend = _torch_backends()[backend]
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim_k=16, head_dim_v=head_dim_v, seed=3)
    case.block_tables.clamp_(max=case.key_cache.shape[0] - 1)  # the CPU plan reads whole block-table rows
    sinks = sink_logits(4) if with_sinks else None
    layer = dict(scale=0.25, sliding_window=sliding_window, softcap=softcap)
    got = attend(case.query, case.key_cache, case.value_cache, case.params(**layer, sinks=sinks))
    assert got.shape == (case.query.shape[0], 4, head_dim_v)
    torch.testing.assert_close(got.double(), oracle(case, **layer, sinks=sinks), atol=2e-5, rtol=2e-5)
    if with_sinks:  # the sinks change the result
        plain = attend(case.query, case.key_cache, case.value_cache, case.params(**layer))
        assert not torch.allclose(plain, got, atol=1e-3)


def test_cpu_decode_batch_with_sinks_takes_the_bucket_path():
    """A pure decode batch with sinks (which the compiled decode kernel does not apply) still equals the oracle."""
    from vllite.kernels.cpu_attention import paged_attention_cpu

    case = make_case([(9, 1), (0, 1), (21, 1)], num_heads=4, num_kv_heads=2, head_dim_k=8, head_dim_v=8, seed=4)
    case.block_tables.clamp_(max=case.key_cache.shape[0] - 1)
    sinks = sink_logits(4, seed=5)
    got = paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.params(scale=0.3, sinks=sinks))
    torch.testing.assert_close(got.double(), oracle(case, scale=0.3, sinks=sinks), atol=2e-5, rtol=2e-5)
