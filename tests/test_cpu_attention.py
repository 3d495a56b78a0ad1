"""The variable-length CPU paged attention (vllite.kernels.cpu_attention / cpu_plan) against the padded reference.

Random batches mix decodes, short multi-token queries (speculative verification, chunked continuations), fresh
prefills and long chunked prefills, with contexts from 0 to ~900 tokens, several block sizes, GQA groups, sliding
windows and softcaps; the plan's buckets are checked to pad each sequence only within its own bucket, and the
attention layer to build one plan per forward pass.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.test_kernels import make_case, naive_attention
from vllite.kernels import PagedAttentionParams, paged_attention, plan_paged_attention, reshape_and_cache
from vllite.kernels.cpu_attention import paged_attention_cpu, reshape_and_cache_cpu
from vllite.kernels.cpu_plan import plan_paged_attention_cpu
from vllite.kernels.reference import paged_attention_ref, reshape_and_cache_ref


def random_specs(rng: random.Random, num_seqs: int) -> list[tuple[int, int]]:
    """``(context_len, query_len)`` per sequence: decodes, 1+k queries, prefills, chunked prefills."""
    specs = []
    for _ in range(num_seqs):
        kind = rng.random()
        if kind < 0.5:
            specs.append((rng.randint(0, 900), 1))
        elif kind < 0.7:
            specs.append((rng.randint(0, 300), rng.randint(2, 6)))
        elif kind < 0.85:
            specs.append((0, rng.randint(1, 120)))
        else:
            specs.append((rng.randint(1, 200), rng.randint(17, 60)))
    return specs


def plan_for(case, *, sliding_window: int | None = None, slot_mapping: torch.Tensor | None = None):
    _, num_heads, head_dim = case.query.shape
    return plan_paged_attention_cpu(
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        block_size=case.key_cache.shape[1],
        num_heads=num_heads,
        num_kv_heads=case.key_cache.shape[2],
        head_dim=head_dim,
        sliding_window=sliding_window,
        slot_mapping=slot_mapping,
    )


@pytest.mark.parametrize("seed", range(24))
def test_random_batches_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    num_kv_heads, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4, 8])
    head_dim, block_size = rng.choice([8, 16, 48]), rng.choice([4, 5, 16])
    window = rng.choice([None, None, 1, 7, 64])
    softcap = rng.choice([None, None, 2.0])
    case = make_case(
        random_specs(rng, rng.randint(1, 12)),
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=seed,
        extra_tokens=rng.choice([0, 2]),
    )
    kw = dict(scale=head_dim**-0.5, sliding_window=window, softcap=softcap)
    expect = paged_attention_ref(*case.args(**kw))
    got = paged_attention_cpu(*case.args(**kw))
    assert got.shape == expect.shape and got.dtype == expect.dtype
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=1e-5)
    # The same plan serves any number of calls (layers).
    plan = plan_for(case, sliding_window=window)
    again = paged_attention_cpu(*case.args(**kw, plan=plan))
    assert torch.equal(paged_attention_cpu(*case.args(**kw, plan=plan)), again)
    torch.testing.assert_close(again, expect, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (8, None), (None, 2.0), (6, 1.5)])
def test_mixed_batch_matches_naive_definition(sliding_window: int | None, softcap: float | None) -> None:
    specs = [(20, 1), (0, 17), (33, 5), (47, 1), (0, 1), (16, 16), (300, 1), (250, 4), (120, 40)]
    case = make_case(specs, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16, seed=7)
    kw = dict(scale=0.3, sliding_window=sliding_window, softcap=softcap)
    got = paged_attention_cpu(*case.args(**kw))
    torch.testing.assert_close(got.double(), naive_attention(case, **kw), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_reference(dtype: torch.dtype) -> None:
    specs = [(700, 1), (16, 1), (0, 40), (90, 4), (300, 1)]
    case = make_case(specs, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype, seed=4)
    expect = paged_attention_ref(*case.args(scale=32**-0.5))
    got = paged_attention_cpu(*case.args(scale=32**-0.5))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expect.float(), atol=2e-2, rtol=2e-2)


def test_padding_rows_and_out_are_respected() -> None:
    specs = [(5, 1), (0, 9), (3, 4), (40, 1)]
    case = make_case(specs, num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, extra_tokens=3)
    out = torch.full_like(case.query, 7.0)
    got = paged_attention_cpu(*case.args(scale=0.5), out=out)
    assert got is out
    valid = int(case.query_start_loc[-1])
    expect = paged_attention_ref(*case.args(scale=0.5))
    torch.testing.assert_close(got[:valid], expect[:valid], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[valid:], torch.full_like(got[valid:], 7.0))
    fresh = paged_attention_cpu(*case.args(scale=0.5))
    assert torch.equal(fresh[valid:], torch.zeros_like(fresh[valid:]))


def test_bucket_padding_follows_each_context() -> None:
    """64 decodes with contexts 16..800: far fewer blocks gathered than padding everyone to the longest."""
    specs = [(16 + (784 * i) // 63, 1) for i in range(64)]
    case = make_case(specs, num_heads=4, num_kv_heads=2, head_dim=48, block_size=16)
    plan = plan_for(case)
    own = sum(-(-(c + 1) // 16) for c, _ in specs)
    gathered = plan.block_index.numel()
    assert gathered == sum(b.num_seqs * b.num_blocks for b in plan.buckets)
    assert own <= gathered <= 1.2 * own
    assert gathered < 0.65 * 64 * 51  # padded to the longest: 64 x 51 blocks
    assert 1 < len(plan.buckets) < 64
    assert sum(b.num_seqs for b in plan.buckets) == 64


def test_uniform_decode_is_one_bucket_without_reordering() -> None:
    case = make_case([(300, 1)] * 16, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    plan = plan_for(case)
    assert len(plan.buckets) == 1 and plan.query_index is None and plan.out_index is None


def test_sliding_window_gathers_only_reachable_blocks() -> None:
    specs = [(800, 1), (500, 3), (0, 100)]
    case = make_case(specs, num_heads=4, num_kv_heads=1, head_dim=16, block_size=16, seed=2)
    plan = plan_for(case, sliding_window=32)
    # Each decode-like query reaches back at most 32 + q_len tokens: 3-4 blocks instead of 51 and 32.
    assert all(b.num_blocks <= 4 for b in plan.buckets if b.q_len <= 3)
    kw = dict(scale=0.25, sliding_window=32)
    expect = paged_attention_ref(*case.args(**kw))
    torch.testing.assert_close(paged_attention_cpu(*case.args(**kw, plan=plan)), expect)


def test_a_plan_for_another_window_is_not_used() -> None:
    case = make_case([(60, 1), (30, 2)], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    wrong = plan_for(case, sliding_window=None)
    kw = dict(scale=0.5, sliding_window=5)
    expect = paged_attention_ref(*case.args(**kw))
    torch.testing.assert_close(paged_attention_cpu(*case.args(**kw, plan=wrong)), expect)


def test_reshape_and_cache_cpu_matches_reference_with_padding_slots() -> None:
    g = torch.Generator().manual_seed(3)
    key_cache = torch.randn(6, 4, 2, 8, generator=g)
    value_cache = torch.randn(6, 4, 2, 8, generator=g)
    key, value = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([13, -1, 0, 22, -1])
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    case = make_case([(2, 3)], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4)
    plan = plan_for(case, slot_mapping=slots)
    assert plan.slots is not None and plan.slots.rows is not None and plan.slots.rows.tolist() == [0, 2, 3]
    for mapping in (slots, plan.slots):
        k, v = key_cache.clone(), value_cache.clone()
        reshape_and_cache_cpu(key, value, k, v, mapping)
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
        k, v = key_cache.clone(), value_cache.clone()
        reshape_and_cache(key, value, k, v, slots, plan=plan if mapping is plan.slots else None)
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
        # Caches that are not one flat view (a strided slice) go through the reference.
        k2, v2 = torch.cat([key_cache, key_cache], 2)[:, :, :2], torch.cat([value_cache, value_cache], 2)[:, :, :2]
        reshape_and_cache_cpu(key, value, k2, v2, mapping)
        assert torch.equal(k2, ref_k) and torch.equal(v2, ref_v)


def test_dispatchers_and_plan_on_cpu() -> None:
    case = make_case([(9, 1), (0, 6)], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    plan = plan_paged_attention(
        case.block_tables, case.seq_lens, case.query_start_loc, key_cache=case.key_cache, num_heads=4
    )
    assert plan is not None and plan.block_size == 4
    expect = paged_attention_ref(*case.args(scale=0.4))
    torch.testing.assert_close(paged_attention(*case.args(scale=0.4, plan=plan)), expect)


def test_attention_layer_builds_one_plan_per_forward_and_window() -> None:
    from vllite.plugins.transformers_executor import attention as attn

    specs = [(12, 1), (0, 5), (30, 2)]
    case = make_case(specs, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=9)
    num_tokens = case.query.shape[0]
    key_cache, value_cache = torch.zeros_like(case.key_cache), torch.zeros_like(case.value_cache)
    # Slots of every query token (the last q_len positions of each sequence), for the cache write.
    slots, tokens_k, tokens_v = [], [], []
    for s, (ctx, q_len) in enumerate(specs):
        for p in range(ctx, ctx + q_len):
            slots.append(int(case.block_tables[s, p // 4]) * 4 + p % 4)
            tokens_k.append(case.dense_k[s][p])
            tokens_v.append(case.dense_v[s][p])
        for p in range(ctx):  # the cached context, written beforehand
            blk, off = int(case.block_tables[s, p // 4]), p % 4
            key_cache[blk, off], value_cache[blk, off] = case.dense_k[s][p], case.dense_v[s][p]
    md = attn.AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=case.block_tables,
        seq_lens=case.seq_lens,
        query_start_loc=case.query_start_loc,
        max_query_len=case.max_query_len,
        max_seq_len=case.max_seq_len,
    )
    key = torch.stack(tokens_k).transpose(0, 1)[None]  # [1, Hkv, T, D]
    value = torch.stack(tokens_v).transpose(0, 1)[None]
    query = case.query.transpose(0, 1)[None]
    layers = []
    for i, window in enumerate([None, 6, None]):
        module = torch.nn.Module()
        module.layer_idx, module.scaling, module.sliding_window = i, 0.35, window
        layers.append(module)
    caches = [(key_cache.clone(), value_cache.clone()) for _ in layers]
    with attn.forward_context(md, caches) as ctx:
        outs = [attn.paged_attention_forward(m, query, key, value, None)[0][0] for m in layers]
    # Plans and arguments are keyed by the metadata they were built over (a KV-cache group's) and the window.
    key = id(md)
    assert ctx.num_calls == 3 and set(ctx.plans) == {(key, None), (key, 6)}
    assert ctx.plans[key, None].slots is not None
    assert set(ctx.params) == {(key, None), (key, 6)} and ctx.params[key, 6].plan is ctx.plans[key, 6]
    for module, got in zip(layers, outs):
        params = case.params(scale=0.35, sliding_window=module.sliding_window)
        expect = paged_attention_ref(case.query, *caches[module.layer_idx], params)
        assert got.shape == (num_tokens, 4, 8)
        torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
        layer_k, layer_v = caches[module.layer_idx]
        for s, (ctx_len, q_len) in enumerate(specs):  # every position of every sequence holds its K/V
            pos = torch.arange(ctx_len + q_len)
            blocks = case.block_tables[s, pos // 4].long()
            assert torch.equal(layer_k[blocks, pos % 4], case.dense_k[s])
            assert torch.equal(layer_v[blocks, pos % 4], case.dense_v[s])


def test_sequences_without_query_tokens_are_skipped() -> None:
    case = make_case([(7, 1), (0, 3), (5, 2)], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    # Sequence 1 gets no query tokens this step: drop its 3 rows and give it seq_len 3 (its cached context).
    keep = torch.tensor([0, 4, 5])
    qsl = torch.tensor([0, 1, 1, 3], dtype=torch.int32)
    seq_lens = torch.tensor([8, 3, 7], dtype=torch.int32)
    params = PagedAttentionParams(case.block_tables, seq_lens, qsl, max_query_len=2, max_seq_len=8, scale=0.5)
    args = (case.query[keep], case.key_cache, case.value_cache, params)
    expect = paged_attention_ref(*args)
    torch.testing.assert_close(paged_attention_cpu(*args), expect)
