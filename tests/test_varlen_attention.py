"""varlen_attention (packed attention within each sequence, no cache) and the encoder path of the attention function.

Every path is checked against a per-sequence SDPA reference in float64: the CPU path (per-sequence calls, padded
buckets, the lone-sequence shortcut), the Triton kernel under ``TRITON_INTERPRET=1`` (set by conftest on
machines without a GPU), and ``paged_attention_forward`` for a module with ``is_causal=False``.
"""

from __future__ import annotations

import importlib
import importlib.util
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from vllite.exceptions import AttentionRoutingError
from vllite.kernels import varlen_attention
from vllite.kernels.varlen_attention import plan_buckets
from vllite.plugins.transformers_executor import attention as attn

# `import vllite.kernels.varlen_attention as m` would give the function vllite.kernels re-exports under that name.
varlen_module = importlib.import_module("vllite.kernels.varlen_attention")


def reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: list[int], scale: float, causal: bool
) -> torch.Tensor:
    """One float64 SDPA call per sequence, KV heads repeated for GQA; rows past ``cu_seqlens[-1]`` stay zero."""
    group = query.shape[1] // key.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for start, end in pairwise(cu_seqlens):
        if end == start:
            continue
        q, k, v = (t[start:end].double().transpose(0, 1) for t in (query, key, value))
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(0, 1)
    return out


def make_batch(
    lengths: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    extra_rows: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(query, key, value, cu_seqlens)`` of a packed batch; ``extra_rows`` padding rows follow the sequences."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths) + extra_rows
    query = torch.randn(total, num_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return query, key, value, cu_seqlens


def random_lengths(count: int, high: int, seed: int) -> list[int]:
    """``count`` lengths in ``[1, high]``, with a 1 and an empty sequence among them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, high + 1, (count,), generator=g).tolist()
    return [1, *lengths[: count // 2], 0, *lengths[count // 2 :]]


# Heads (query, KV) and head_dim: GQA group 2, group 3, plain multi-head attention.
SHAPES = [(4, 2, 16), (3, 1, 8), (2, 2, 32)]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]

# ----------------------------------------------------------------------------------------------- CPU path


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("calls", ["planned", "one per sequence", "one bucket"])
def test_cpu_path_matches_per_sequence_sdpa(
    monkeypatch: pytest.MonkeyPatch,
    calls: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    tol: float,
    causal: bool,
) -> None:
    # The call overhead of the cost model decides between lone calls and padded buckets: 0 forces the former,
    # a second per call the latter (all sequences in one bucket), so both code paths meet the reference.
    if calls != "planned":
        monkeypatch.setattr(varlen_module, "CALL_S", 0.0 if calls == "one per sequence" else 1.0)
    lengths = [*random_lengths(9, 40, seed=num_heads), 130]
    query, key, value, cu_seqlens = make_batch(
        lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, extra_rows=3
    )
    got = varlen_attention(query, key, value, cu_seqlens, max(lengths), 0.3, causal=causal)
    expect = reference(query, key, value, cu_seqlens.tolist(), 0.3, causal)
    assert got.shape == query.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), expect, atol=tol, rtol=tol)
    assert not got[-3:].any()  # the padding rows past cu_seqlens[-1]


@pytest.mark.parametrize("causal", [False, True])
def test_single_sequence_and_empty_batch(causal: bool) -> None:
    query, key, value, cu_seqlens = make_batch([23], num_heads=4, num_kv_heads=1, head_dim=16)
    got = varlen_attention(query, key, value, cu_seqlens, 23, 0.25, causal=causal)
    expect = reference(query, key, value, [0, 23], 0.25, causal)
    torch.testing.assert_close(got.double(), expect, atol=1e-5, rtol=1e-5)

    empty = varlen_attention(query[:0], key[:0], value[:0], torch.zeros(1, dtype=torch.int32), 0, 0.25, causal=causal)
    assert empty.shape == (0, 4, 16)


def test_causal_and_bidirectional_differ_only_where_the_future_is_visible() -> None:
    query, key, value, cu_seqlens = make_batch([5, 7], num_heads=2, num_kv_heads=2, head_dim=8)
    bidirectional = varlen_attention(query, key, value, cu_seqlens, 7, 0.5)
    causal = varlen_attention(query, key, value, cu_seqlens, 7, 0.5, causal=True)
    # The last token of each sequence sees the whole sequence either way; the first sees only itself when causal.
    for last in (4, 11):
        torch.testing.assert_close(bidirectional[last], causal[last], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(causal[5], value[5], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(bidirectional[5], causal[5])


def test_plan_buckets_pads_only_short_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = [300, 2, 0, 3, 2, 150, 1, 3]
    shape = dict(num_heads=12, num_kv_heads=12, head_dim=64, causal=False)
    buckets = plan_buckets(lengths, **shape, num_threads=1)
    assert buckets == [[0], [5], [3, 7, 1, 4, 6]]  # long ones alone, longest first; the short ones share a call
    # More threads make the copies cheaper against the fixed cost of a call, so longer sequences share calls.
    assert plan_buckets([40, 30, 0], **shape, num_threads=1) == [[0], [1]]
    assert plan_buckets([40, 30, 0], **shape, num_threads=16) == [[0, 1]]
    # Padding a short sequence to a much longer one costs more than the call it saves.
    assert plan_buckets([60, 2, 2], **shape, num_threads=16) == [[0], [1, 2]]
    monkeypatch.setattr(varlen_module, "CALL_S", 0.0)  # with a free call, nothing is worth padding
    assert plan_buckets(lengths, **shape, num_threads=1) == [[0], [5], [3], [7], [1], [4], [6]]


def test_rejects_mismatched_heads_and_shapes() -> None:
    query, key, value, cu_seqlens = make_batch([4], num_heads=3, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        varlen_attention(query, key, value, cu_seqlens, 4, 1.0)
    query, key, value, cu_seqlens = make_batch([4], num_heads=2, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="dtypes differ"):
        varlen_attention(query, key.double(), value, cu_seqlens, 4, 1.0)
    with pytest.raises(ValueError, match="do not match query"):
        varlen_attention(query, key[:3], value[:3], cu_seqlens, 4, 1.0)


# ------------------------------------------------------------------------ Triton kernel (interpreter)

triton_cpu = pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="interpreter tests run on CPU-only machines with triton installed",
)


@triton_cpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("lengths", "num_heads", "num_kv_heads", "head_dim", "dtype", "tol"),
    [
        ([1, 17, 0, 70, 5], 4, 2, 16, torch.float32, 1e-5),  # 70 rows: two query blocks and two key tiles
        ([3, 12, 1], 3, 1, 12, torch.float32, 1e-5),  # group 3, head_dim padded to 16, 16-row blocks
        # The half-precision branch (dots in the input dtype, float32 accumulation). In float16: the interpreter's
        # bfloat16 tl.dot multiplies raw bit patterns (triton-lang/triton#11584); bfloat16 runs in the cuda test.
        ([9, 30], 2, 2, 16, torch.float16, 2e-3),
    ],
)
def test_triton_kernel_interpreter_matches_per_sequence_sdpa(
    lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    tol: float,
    causal: bool,
) -> None:
    from vllite.kernels.triton_varlen_attention import varlen_attention_triton

    query, key, value, cu_seqlens = make_batch(
        lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, extra_rows=2
    )
    got = varlen_attention_triton(query, key, value, cu_seqlens, max(lengths), 0.3, causal)
    expect = reference(query, key, value, cu_seqlens.tolist(), 0.3, causal)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expect, atol=tol, rtol=tol)
    assert not got[-2:].any()


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 5e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(12, 12, 64), (32, 8, 128), (12, 4, 80)])
def test_triton_kernel_cuda_matches_per_sequence_sdpa(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, tol: float, causal: bool
) -> None:
    lengths = [*random_lengths(40, 300, seed=1), 513]
    query, key, value, cu_seqlens = make_batch(
        lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, extra_rows=5
    )
    expect = reference(query, key, value, cu_seqlens.tolist(), head_dim**-0.5, causal)
    args = (t.cuda() for t in (query, key, value, cu_seqlens))
    got = varlen_attention(*args, max(lengths), head_dim**-0.5, causal=causal)
    assert got.is_cuda and got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), expect, atol=tol, rtol=tol)


# ------------------------------------------------------------------- paged_attention_forward, encoder path


def _boom(*args: object, **kwargs: object) -> None:
    raise AssertionError("the encoder path must not touch the KV cache or the paged kernels")


def _encoder_step(lengths: list[int], seq_lens: list[int]) -> attn.AttentionMetadata:
    qsl = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return attn.AttentionMetadata(
        slot_mapping=torch.arange(sum(lengths)),
        block_tables=torch.zeros(len(lengths), 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        max_query_len=max(lengths),
        max_seq_len=max(seq_lens),
    )


def _encoder_layer() -> torch.nn.Module:
    module = torch.nn.Module()
    module.is_causal, module.scaling = False, 0.3  # as BertSelfAttention sets them; no layer_idx needed
    return module


def test_encoder_layers_attend_bidirectionally_without_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attn, "_kernels", (_boom, _boom))
    monkeypatch.setattr(attn, "_planner", None)
    lengths = [6, 1, 13]
    query, key, value, cu_seqlens = make_batch(lengths, num_heads=4, num_kv_heads=2, head_dim=8)
    md = _encoder_step(lengths, seq_lens=lengths)
    caches = [(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8))]
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, T, dim], as transformers passes
    with attn.forward_context(md, caches) as ctx:
        first, weights = attn.paged_attention_forward(_encoder_layer(), q, k, v, None)
        assert ctx.whole_inputs
        # The check ran once for the forward: the next layer does not look at the metadata's lengths again.
        md.seq_lens[0] += 5
        second, _ = attn.paged_attention_forward(_encoder_layer(), q, k, v, None)
    assert weights is None and ctx.num_calls == 2
    expect = reference(query, key, value, cu_seqlens.tolist(), 0.3, causal=False)
    for got in (first, second):
        assert got.shape == (1, 20, 4, 8)
        torch.testing.assert_close(got[0].double(), expect, atol=1e-5, rtol=1e-5)
    assert not any(c.any() for pair in caches for c in pair)


def test_encoder_layers_need_each_whole_input_in_the_step() -> None:
    lengths = [4, 3]
    query, key, value, _ = make_batch(lengths, num_heads=2, num_kv_heads=2, head_dim=8)
    md = _encoder_step(lengths, seq_lens=[4, 10])  # sequence 1 has 7 cached tokens
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
    with attn.forward_context(md, []) as ctx, pytest.raises(AttentionRoutingError, match="whole input in one step"):
        attn.paged_attention_forward(_encoder_layer(), q, k, v, None)
    assert ctx.num_calls == 1 and not ctx.whole_inputs


def test_bert_layers_take_the_encoder_path() -> None:
    """transformers' BertSelfAttention (is_causal=False) over a packed batch matches BERT run on each text alone."""
    from transformers import BertConfig, BertModel

    name = attn.register_attention()
    torch.manual_seed(0)
    shape = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    eager = BertModel(BertConfig(**shape, attn_implementation="eager"), add_pooling_layer=False).eval()
    packed = BertModel(BertConfig(**shape, attn_implementation=name), add_pooling_layer=False).eval()
    packed.load_state_dict(eager.state_dict())
    lengths = [5, 9, 1]
    texts = [torch.randint(1, 100, (n,)) for n in lengths]
    ids = torch.cat(texts)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad(), attn.forward_context(_encoder_step(lengths, seq_lens=lengths), []) as ctx:
        out = packed(input_ids=ids, position_ids=positions, token_type_ids=torch.zeros_like(ids)).last_hidden_state[0]
        assert ctx.num_calls == 2
        for text, rows in zip(texts, torch.split(out, lengths)):
            torch.testing.assert_close(rows, eager(input_ids=text[None]).last_hidden_state[0], atol=1e-5, rtol=1e-5)
