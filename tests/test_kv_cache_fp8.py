"""``--kv-cache-dtype fp8`` (fp8_e4m3, fp8_e5m2) on the CPU path.

The kernels against the torch reference on the same fp8 cache (the compiled decode kernel, the gather + SDPA path of
mixed batches, the cache write with its saturation), every fp8 byte widened exactly as torch widens it, and the engine
end to end: an fp8 engine's greedy tokens leave the float32 engine's only where float32 itself faced a near-tie,
with the logprobs of the agreed tokens within a bound a wrong scale or format exceeds (measured: a write scale off by
1.25x gives 0.08 and diverges on a 0.10 margin); 4x the blocks of float32 in the same space; the flag accepted, a bad
value refused naming it, CUDA refused at start-up.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.test_cpu_attention import random_specs
from tests.test_kernels import make_case
from vllite import LLM, EngineArgs, SamplingParams
from vllite.exceptions import DeviceUnavailableError
from vllite.kernels import PagedAttentionParams, cpu_attention, cpu_decode
from vllite.kernels.cpu_attention import paged_attention_cpu, reshape_and_cache_cpu
from vllite.kernels.kv_cache_dtype import dequantize_kv, kv_cache_torch_dtype, quantize_kv
from vllite.kernels.reference import paged_attention_ref, reshape_and_cache_ref
from vllite.testing import make_tiny_model_dir_cached

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


def _fp8_case(specs, dtype, *, heads=8, kv_heads=2, head_dim=48, block_size=16, seed=0, k_scale=0.5, v_scale=2.0):
    """A paged case whose caches hold ``make_case``'s values quantized to ``dtype`` with the given scales."""
    case = make_case(specs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, seed=seed)
    case.key_cache = quantize_kv(case.key_cache * 3, dtype, k_scale)  # keys wider than 1: the scale matters
    case.value_cache = quantize_kv(case.value_cache, dtype, v_scale)
    return case


def _params(case, *, scale, k_scale, v_scale):
    return PagedAttentionParams(
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        max_query_len=case.max_query_len,
        max_seq_len=case.max_seq_len,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def _kernel():
    if cpu_decode.decode_kernel() is None:
        pytest.skip("the decode kernel could not be built here")


# ---------------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"), [(8, 4, 64, 16), (8, 2, 20, 5), (6, 3, 128, 16)]
)
@pytest.mark.parametrize("num_seqs", [17, 2])
def test_decode_kernel_on_an_fp8_cache_equals_the_reference(dtype, heads, kv_heads, head_dim, block_size, num_seqs):
    """Vectorised (eight at a time) and tail (head size 20) conversions; k_scale and v_scale not 1."""
    _kernel()
    rng = random.Random(head_dim)
    specs = [(rng.randint(0, 300), 1) for _ in range(num_seqs)]
    case = _fp8_case(specs, dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    params = _params(case, scale=head_dim**-0.5, k_scale=0.5, v_scale=2.0)
    expected = paged_attention_ref(case.query, case.key_cache, case.value_cache, params)
    direct = cpu_decode.paged_decode_attention(
        case.query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        scale=params.scale,
        k_scale=0.5,
        v_scale=2.0,
    )
    assert direct is not None
    torch.testing.assert_close(direct, expected, rtol=1e-5, atol=1e-5)
    out = torch.full_like(case.query, float("nan"))
    assert paged_attention_cpu(case.query, case.key_cache, case.value_cache, params, out=out) is out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # The scales are applied: without them the answer differs.
    unscaled = _params(case, scale=head_dim**-0.5, k_scale=1.0, v_scale=1.0)
    assert not torch.allclose(paged_attention_ref(case.query, case.key_cache, case.value_cache, unscaled), expected)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_every_fp8_byte_is_widened_as_torch_widens_it(dtype, query_dtype):
    """One-token contexts return their value row times v_scale exactly, so each finite byte pattern (subnormals,
    the largest, negatives) comes back as torch's own conversion of it."""
    _kernel()
    finite = torch.arange(256, dtype=torch.uint8).view(dtype).float().isfinite()
    patterns = torch.arange(256, dtype=torch.uint8)[finite]
    head_dim = 16
    rows = -(-patterns.numel() // head_dim)
    padded = torch.zeros(rows * head_dim, dtype=torch.uint8)
    padded[: patterns.numel()] = patterns
    values = padded.view(dtype).view(rows, 1, 1, head_dim)
    keys = torch.zeros_like(values)
    tables = torch.arange(rows, dtype=torch.int32).unsqueeze(1)
    lens = torch.ones(rows, dtype=torch.int32)
    query = torch.randn(rows, 1, head_dim).to(query_dtype)
    got = cpu_decode.paged_decode_attention(query, keys, values, tables, lens, scale=0.1, v_scale=0.25)
    assert got is not None
    expected = (values.float() * 0.25).view(rows, 1, head_dim)
    if query_dtype == torch.bfloat16:
        expected = expected.bfloat16()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("seed", range(6))
def test_mixed_batches_on_an_fp8_cache_equal_the_reference(dtype, seed):
    """Prefills, chunked prefills, short multi-token queries and decodes: the gather + SDPA path widens the gathered
    bytes (times the scales) and then computes as on a float32 cache."""
    rng = random.Random(seed)
    kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 4])
    head_dim, block_size = rng.choice([8, 16, 48]), rng.choice([4, 16])
    specs = [*random_specs(rng, rng.randint(2, 8)), (0, 12)]  # at least one multi-token query
    case = _fp8_case(
        specs, dtype, heads=kv_heads * group, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, seed=seed
    )
    params = _params(case, scale=head_dim**-0.5, k_scale=0.5, v_scale=2.0)
    expected = paged_attention_ref(case.query, case.key_cache, case.value_cache, params)
    got = paged_attention_cpu(case.query, case.key_cache, case.value_cache, params)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    # Against float32 attention over the dequantized cache: the same numbers by definition.
    k32 = dequantize_kv(case.key_cache, torch.float32, 0.5)
    v32 = dequantize_kv(case.value_cache, torch.float32, 2.0)
    plain = _params(case, scale=head_dim**-0.5, k_scale=1.0, v_scale=1.0)
    torch.testing.assert_close(got, paged_attention_ref(case.query, k32, v32, plain), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_the_compiled_widening_of_gathered_blocks_equals_torch(dtype):
    """The gather path widens float32 copies with the compiled module: every finite byte, times the scale, exactly
    as torch converts it; and a bfloat16 model's gather path (torch's conversion) matches the reference."""
    _kernel()
    finite = torch.arange(256, dtype=torch.uint8).view(dtype).float().isfinite()
    cache = torch.arange(256, dtype=torch.uint8)[finite].repeat(1000).view(dtype)  # several threads' chunks
    out = torch.empty(cache.shape)
    assert cpu_decode.widen_fp8(cache, 0.75, out)
    assert torch.equal(out, cache.float() * 0.75)
    assert not cpu_decode.widen_fp8(cache, 0.75, torch.empty(cache.shape, dtype=torch.bfloat16))
    case = _fp8_case([(40, 1), (0, 30), (100, 7)], dtype, seed=5)
    params = _params(case, scale=48**-0.5, k_scale=0.5, v_scale=2.0)
    expected = paged_attention_ref(case.query, case.key_cache, case.value_cache, params)
    got = paged_attention_cpu(case.query.bfloat16(), case.key_cache, case.value_cache, params)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_the_cache_write_quantizes_with_the_scale_and_saturates(dtype):
    g = torch.Generator().manual_seed(1)
    key = torch.randn(7, 2, 8, generator=g) * 4
    value = torch.randn(7, 2, 8, generator=g)
    key[0, 0, 0], key[1, 1, 1], value[3, 0, 3] = 1e9, -1e9, 3e5  # beyond both formats' range
    slots = torch.tensor([3, 0, -1, 9, 17, 5, 30])
    caches = [torch.zeros(4, 8, 2, 8, dtype=dtype) for _ in range(4)]
    reshape_and_cache_cpu(key, value, caches[0], caches[1], slots, k_scale=0.5, v_scale=2.0)
    reshape_and_cache_ref(key, value, caches[2], caches[3], slots, k_scale=0.5, v_scale=2.0)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    written = caches[0].view(32, 2, 8).float()
    top = torch.finfo(dtype).max
    assert written[3, 0, 0] == top and written[0, 1, 1] == -top  # saturated, not inf or NaN
    assert written.isfinite().all() and caches[1].view(32, 2, 8).float()[9, 0, 3] == top
    # Away from saturation a stored key is key / k_scale to the format's precision.
    rel = 2**-4 if dtype == torch.float8_e4m3fn else 2**-3
    stored, exact = written[17], key[4] / 0.5
    assert ((stored - exact).abs() <= rel * exact.abs() + 1e-6).all()


# ---------------------------------------------------------------------------------------------------- the engine
PROMPTS, MAX_TOKENS = 16, 24
#: Where an fp8 engine's greedy token leaves float32's, float32's top two logprobs are at most this far apart.
NEAR_TIE = 0.05
#: The largest logprob difference of an agreed token (measured 0.015 for e4m3, 0.025 for e5m2: 2 vs 3 mantissa
#: bits), and the least share of the tokens agreed before the first divergence (measured 65% and 47%).
LOGPROB_TOL = {"fp8": 0.04, "fp8_e5m2": 0.06}
MIN_AGREEMENT = {"fp8": 0.5, "fp8_e5m2": 0.35}


@pytest.fixture(scope="module")
def tiny_llama() -> str:
    return str(make_tiny_model_dir_cached("llama", hidden_size=128, seed=3))


def _engine(model_dir: str, kv_cache_dtype: str) -> LLM:
    return LLM(model=model_dir, max_model_len=256, kv_cache_dtype=kv_cache_dtype, cpu_kvcache_space=0.01, device="cpu")


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_executor.runner  # in-process (VLLITE_ENABLE_MULTIPROCESSING=0)


@pytest.fixture(scope="module")
def float32_run(tiny_llama):
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(rng.randint(4, 120))] for _ in range(PROMPTS)]
    llm = _engine(tiny_llama, "auto")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, outputs, _runner(llm).num_kv_blocks


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_engine_follows_float32_up_to_near_ties(monkeypatch, tiny_llama, float32_run, kv_cache_dtype):
    """Through the compiled decode kernel where it builds, else through the gather path (no C++ compiler, or
    VLLITE_CPU_DECODE_KERNEL=0): the same bounds either way."""
    compiled = cpu_decode.decode_kernel() is not None
    prompts, reference, _ = float32_run
    decode_calls = []
    original = cpu_attention.paged_decode_attention

    def counting(*args, **kwargs):
        result = original(*args, **kwargs)
        decode_calls.append(result is not None and args[1].element_size() == 1)
        return result

    monkeypatch.setattr(cpu_attention, "paged_decode_attention", counting)
    llm = _engine(tiny_llama, kv_cache_dtype)
    key_cache = _runner(llm).kv_caches[0][0]
    assert key_cache.dtype == kv_cache_torch_dtype(kv_cache_dtype, torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if compiled:
        assert decode_calls and all(decode_calls), "fp8 decode must run in the compiled kernel"
    else:
        assert not any(decode_calls), "without the kernel, fp8 decode goes through the gather path"

    agreed, worst = 0, 0.0
    for ours, theirs in zip(outputs, reference):
        tokens, ref_tokens = ours.outputs[0].token_ids, theirs.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), MAX_TOKENS)
        agreed += same
        for step in range(same):
            ref_lp = theirs.outputs[0].logprobs[step][ref_tokens[step]].logprob
            worst = max(worst, abs(ours.outputs[0].logprobs[step][tokens[step]].logprob - ref_lp))
        if same < MAX_TOKENS:
            top2 = sorted((lp.logprob for lp in theirs.outputs[0].logprobs[same].values()), reverse=True)[:2]
            assert top2[0] - top2[1] <= NEAR_TIE, f"diverged at step {same} on a clear float32 choice {top2}"
    assert 0.0 < worst <= LOGPROB_TOL[kv_cache_dtype], worst  # lossy (so fp8 was used), within the bound
    assert agreed >= MIN_AGREEMENT[kv_cache_dtype] * PROMPTS * MAX_TOKENS, agreed


def test_an_fp8_cache_holds_four_times_the_float32_blocks(tiny_llama, float32_run):
    *_, float32_blocks = float32_run
    llm = _engine(tiny_llama, "fp8")
    fp8_blocks = _runner(llm).num_kv_blocks
    assert fp8_blocks // 4 == float32_blocks  # floor(4x / 4): the same bytes, a quarter per block
    assert _runner(llm).kv_caches[0][0].element_size() == 1


def test_the_flag_reaches_the_cache_config_and_bad_values_are_refused():
    config = EngineArgs(kv_cache_dtype="fp8_e5m2").create_engine_config()
    assert config.cache_config.kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match=r"--kv-cache-dtype \(kv_cache_dtype\) must be one of auto, fp8, fp8_e4m3"):
        EngineArgs(kv_cache_dtype="fp16").create_engine_config()
    with pytest.raises(ValueError, match="cannot be combined with a KV connector"):
        EngineArgs(kv_cache_dtype="fp8", kv_offload_size=1.0).create_engine_config()
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        kv_cache_torch_dtype("int8", torch.float32)


def test_fp8_on_cuda_is_refused_at_start_up(tiny_llama):
    """The Triton kernels read no fp8: asking for it on CUDA fails before the model loads (here, before the missing
    device is even noticed)."""
    with pytest.raises(DeviceUnavailableError, match="--kv-cache-dtype fp8 is implemented on the CPU path only"):
        LLM(model=tiny_llama, device="cuda", kv_cache_dtype="fp8", max_model_len=256)
