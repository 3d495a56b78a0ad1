"""Attention never reads what a sequence did not write: stale KV memory (NaN or Inf) must not leak into outputs.

A freed block keeps whatever its last owner wrote; a model that produced NaN keys and values leaves NaN there, and the
null block or freshly allocated memory may hold any bit pattern. Every slot past a sequence's length (the tail of its
last block, a bucket's padding blocks) and every block out of its sliding window (which the KV-cache manager swaps
for the null block) must contribute exactly nothing: a masked score times a NaN value is NaN, not 0. Each attention
path runs on a cache whose unused slots are NaN and must equal the same path on clean memory; and an engine whose
whole KV cache is NaN before serving still generates Hugging Face's greedy tokens.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random

import pytest
import torch

from tests.test_cpu_attention import random_specs
from tests.test_engine_diagnostics import CLEAN_PROMPT, NAN_PROMPT, nan_model, nans_per_request, request  # noqa: F401 (fixture)
from tests.test_generation_equivalence import _hf_greedy
from tests.test_kernels import PagedCase, make_case
from vllite import LLM, EngineArgs, SamplingParams
from vllite.engine.core import EngineCore
from vllite.kernels import cpu_decode
from vllite.kernels.cpu_attention import paged_attention_cpu
from vllite.kernels.kv_cache_dtype import quantize_kv
from vllite.kernels.reference import paged_attention_ref
from vllite.testing import make_tiny_model_dir_cached

#: ``(context_len, query_len)``: decodes, a fresh prefill and chunked prefills whose lengths end inside a block.
MIXED = [(20, 1), (0, 17), (33, 5), (47, 1), (0, 1), (0, 3), (120, 40), (250, 4), (7, 1)]
DECODE = [(20, 1), (47, 1), (0, 1), (300, 1), (5, 1), (130, 1)]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
NAN_BYTE = 0x7F  # NaN in both fp8 formats


def _stale_slots(case: PagedCase, window: int | None) -> torch.Tensor:
    """``[num_blocks, block_size]``: True for every slot no sequence of ``case`` may read (past its length, or in
    a block wholly before its first query's window)."""
    num_blocks, block_size = case.key_cache.shape[:2]
    stale = torch.ones(num_blocks, block_size, dtype=torch.bool)
    q_lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    for s, (seq_len, q_len) in enumerate(zip(case.seq_lens.tolist(), q_lens)):
        first = 0 if window is None else max(seq_len - q_len - window + 1, 0) // block_size * block_size
        pos = torch.arange(first, seq_len)
        stale[case.block_tables[s, pos // block_size].long(), pos % block_size] = False
    return stale


def _poisoned(case: PagedCase, window: int | None = None) -> PagedCase:
    """``case`` with NaN in every slot it may not read, and the blocks wholly out of a sequence's window swapped for
    one all-NaN block (as the KV-cache manager swaps them for the null block)."""
    stale = _stale_slots(case, window)
    caches = []
    for cache in (case.key_cache, case.value_cache):
        cache = cache.clone()
        if cache.element_size() == 1:
            cache.view(torch.uint8)[stale] = NAN_BYTE
        else:
            cache[stale] = float("nan")
        caches.append(cache)
    tables = case.block_tables.clone()
    if window is not None:
        null = int(stale.all(1).nonzero()[0, 0])  # a block no sequence owns: all NaN
        q_lens = case.query_start_loc[1:] - case.query_start_loc[:-1]
        for s, (seq_len, q_len) in enumerate(zip(case.seq_lens.tolist(), q_lens.tolist())):
            tables[s, : max(seq_len - q_len - window + 1, 0) // case.key_cache.shape[1]] = null
    return dataclasses.replace(case, key_cache=caches[0], value_cache=caches[1], block_tables=tables)


def _case(specs, *, dtype=torch.float32, block_size=16, heads=6, kv_heads=2, head_dim=16, seed=0) -> PagedCase:
    case = make_case(specs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, seed=seed)
    if dtype.is_floating_point and dtype.itemsize == 1:
        case.key_cache, case.value_cache = quantize_kv(case.key_cache, dtype), quantize_kv(case.value_cache, dtype)
    elif dtype != torch.float32:
        case = dataclasses.replace(
            case,
            query=case.query.to(dtype),
            key_cache=case.key_cache.to(dtype),
            value_cache=case.value_cache.to(dtype),
        )
    return case


def _assert_same(attention, case: PagedCase, window: int | None = None, **layer) -> None:
    """``attention`` on ``case`` with its unread slots poisoned equals ``attention`` on the clean ``case``."""
    kw = dict(scale=case.query.shape[-1] ** -0.5, sliding_window=window, **layer)
    clean = attention(*case.args(**kw))
    assert not clean.isnan().any()
    got = attention(*_poisoned(case, window).args(**kw))
    nan_rows = got.isnan().flatten(1).any(1).nonzero().flatten().tolist()
    assert not nan_rows, f"stale NaN leaked into query rows {nan_rows}"
    torch.testing.assert_close(got, clean, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------------- torch paths
@pytest.mark.parametrize("attention", [paged_attention_ref, paged_attention_cpu], ids=["reference", "cpu"])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (None, 2.0), (24, None), (5, 1.5)])
def test_mixed_batch_ignores_stale_slots(attention, window, softcap) -> None:
    _assert_same(attention, _case(MIXED), window, softcap=softcap)


@pytest.mark.parametrize("attention", [paged_attention_ref, paged_attention_cpu], ids=["reference", "cpu"])
@pytest.mark.parametrize("seed", range(4))
def test_random_batches_ignore_stale_slots(attention, seed) -> None:
    rng = random.Random(seed)
    case = _case(random_specs(rng, rng.randint(1, 10)), block_size=rng.choice([4, 5, 16]), seed=seed)
    _assert_same(attention, case, rng.choice([None, None, 7, 64]), softcap=rng.choice([None, 2.0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, *FP8], ids=["bf16", "e4m3", "e5m2"])
@pytest.mark.parametrize("attention", [paged_attention_ref, paged_attention_cpu], ids=["reference", "cpu"])
def test_narrow_caches_ignore_stale_slots(attention, dtype) -> None:
    _assert_same(attention, _case(MIXED, dtype=dtype))


@pytest.mark.parametrize("window", [None, 16])
def test_decode_batches_ignore_stale_slots(window) -> None:
    """Pure decode: the compiled kernel (without a window) or the gather path (with one)."""
    _assert_same(paged_attention_cpu, _case(DECODE, heads=8, kv_heads=2), window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *FP8], ids=["f32", "bf16", "e4m3", "e5m2"])
def test_compiled_decode_kernel_ignores_stale_slots(dtype) -> None:
    if cpu_decode.decode_kernel() is None:
        pytest.skip("the decode kernel could not be built here")

    def kernel(query, key_cache, value_cache, params):
        out = cpu_decode.paged_decode_attention(
            query, key_cache, value_cache, params.block_tables, params.seq_lens, scale=params.scale
        )
        assert out is not None
        return out

    _assert_same(kernel, _case(DECODE, dtype=dtype, heads=8, kv_heads=2, head_dim=32))


# ---------------------------------------------------------------------------------------------------- Triton
triton_cpu = pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="interpreter tests run on CPU-only machines with triton installed",
)


@triton_cpu
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, 2.0)])
def test_triton_interpreter_ignores_stale_slots(window, softcap) -> None:
    from vllite.kernels.triton_attention import paged_attention_triton

    def attention(query, key_cache, value_cache, params):
        return paged_attention_triton(query, key_cache, value_cache, params, out=torch.zeros_like(query))

    # Block size 4 and windows shorter than a 16-key tile: the tile before the window reaches a swapped-out block.
    case = _case([(5, 1), (0, 7), (21, 4)], block_size=4, heads=2, kv_heads=1)
    _assert_same(attention, case, window, softcap=softcap)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
def test_triton_cuda_ignores_stale_slots(dtype, window) -> None:
    from vllite.kernels.triton_attention import paged_attention_triton

    specs = [(200, 1), (0, 130), (257, 70), (33, 1), (0, 1), (512, 3), *[(i * 17, 1) for i in range(1, 20)]]
    case = _case(specs, dtype=dtype, heads=8, kv_heads=2, head_dim=64)
    case = dataclasses.replace(case, **{f.name: _cuda(getattr(case, f.name)) for f in dataclasses.fields(case)})
    _assert_same(paged_attention_triton, case, window)


def _cuda(value):
    return value.cuda() if isinstance(value, torch.Tensor) else value


# ------------------------------------------------------------------------------------------------ end to end
def test_an_engine_whose_kv_cache_starts_as_nan_still_generates_hf_greedy_tokens() -> None:
    """As after a request whose model wrote NaN keys and values, or on memory that was never zeroed: prompts whose
    lengths end inside a block, batched (mixed buckets) and one by one (a lone prefill, then compiled decode). No
    prefix caching: a cached prefix block poisoned here would hold NaN for real."""
    model_dir = str(make_tiny_model_dir_cached("llama"))
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 500) for _ in range(n)] for n in (3, 21, 37, 50, 9)]
    expected = [tokens for tokens, _ in _hf_greedy(model_dir, prompts, 6)]
    llm = LLM(model_dir, dtype="float32", block_size=16, max_model_len=128, enable_prefix_caching=False)
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.runner  # in-process (tests/conftest.py)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for batch in (range(len(prompts)), [0], [3]):
            runner._kv_buffer.fill_(float("nan"))
            outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in batch], params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == [expected[i] for i in batch]
    finally:
        llm.shutdown()


def test_a_clean_request_after_a_nan_request_gets_clean_logits(nan_model, monkeypatch) -> None:  # noqa: F811 (fixture)
    """The reported case: a model with one NaN embedding row writes NaN keys and values for a prompt holding that
    token; the next request reuses its freed block and its prefill must not see them."""
    monkeypatch.setenv("VLLITE_COMPUTE_NANS_IN_LOGITS", "1")
    config = EngineArgs(model=nan_model, dtype="float32", max_model_len=64, block_size=16).create_engine_config()
    core = EngineCore(config)
    try:
        nans = nans_per_request(core, [request("clean", CLEAN_PROMPT)])
        nans |= nans_per_request(core, [request("nan", NAN_PROMPT)])
        nans |= nans_per_request(core, [request("again", CLEAN_PROMPT)])
    finally:
        core.shutdown()
    assert nans["nan"] == [core.info.vocab_size] * 3  # it did write NaN into the block the next request gets
    assert nans["clean"] == nans["again"] == [0, 0, 0]
