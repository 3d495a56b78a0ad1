"""bfloat16 on the CPU: ``dtype="auto"`` picks it for half-precision checkpoints where the CPU computes in bfloat16
natively (AVX512-BF16 or AMX), as vLLM's CPU build does, and a bfloat16 engine agrees with Hugging Face ``generate()``
in bfloat16 up to the first near-tie that bfloat16 rounding can flip.

The rest of the suite runs with ``VLLITE_CPU_BF16=0`` (tests/conftest.py), so the float32 oracle holds on any CI
machine; these tests set the override themselves.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernel_support import count_fused_steps, kernel_switch
from vllite import LLM, SamplingParams
from vllite.kernels import cpu_attention, cpu_decode
from vllite.kernels.cpu_decode_step import decode_step_kernel
from vllite.plugins.transformers_executor import model_loader
from vllite.plugins.transformers_executor.model_loader import resolve_dtype
from vllite.testing import make_tiny_model_dir_cached

CPU = torch.device("cpu")
PROMPTS, MAX_TOKENS = 16, 24
# A divergence from HF bfloat16 is a rounding flip only where HF's bfloat16 top-2 logits are this close, relative to
# the top one: two bfloat16 units in the last place (2 * 2**-8).
NEAR_TIE = 2 * 2**-8
# Logprobs of the agreed tokens against HF float32: bfloat16 keeps 8 significant bits of every activation.
LOGPROB_TOL = 0.1


class _Config:
    def __init__(self, dtype: str) -> None:
        self.torch_dtype = dtype


@pytest.mark.parametrize(
    ("native", "checkpoint", "expected"),
    [
        ("1", "bfloat16", torch.bfloat16),
        ("1", "float16", torch.bfloat16),  # float16 is never chosen on a CPU
        ("1", "float32", torch.float32),  # a float32 checkpoint stays float32
        ("0", "bfloat16", torch.float32),
        ("0", "float16", torch.float32),
    ],
)
def test_auto_picks_bfloat16_for_half_precision_checkpoints_where_the_cpu_has_it(
    monkeypatch, native, checkpoint, expected
):
    monkeypatch.setenv("VLLITE_CPU_BF16", native)
    assert resolve_dtype("auto", _Config(checkpoint), CPU) == expected


@pytest.mark.parametrize(("flags", "expected"), [({"avx512_bf16"}, True), ({"amx_bf16"}, True), ({"avx2"}, False)])
def test_native_bfloat16_is_read_off_the_cpu_flags(monkeypatch, flags, expected):
    monkeypatch.delenv("VLLITE_CPU_BF16", raising=False)
    monkeypatch.setattr(model_loader, "_cpu_flags", lambda: frozenset(flags))
    assert model_loader.cpu_has_native_bfloat16() is expected


def test_an_explicit_dtype_is_always_honoured(monkeypatch):
    monkeypatch.setenv("VLLITE_CPU_BF16", "0")
    assert resolve_dtype("bfloat16", _Config("float32"), CPU) == torch.bfloat16
    assert resolve_dtype("float32", _Config("bfloat16"), CPU) == torch.float32


def _hf_greedy(model_dir: str, prompts: list[list[int]], dtype: torch.dtype) -> list[tuple[list[int], torch.Tensor]]:
    """HF's greedy tokens and its float32 logits at each step, for ``prompts`` in ``dtype``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), generation_config=config, output_scores=True, return_dict_in_generate=True
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            results.append((tokens, torch.stack([s[0].float() for s in out.scores])))
    return results


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "model-forward"])
def test_a_bfloat16_engine_agrees_with_hf_bfloat16_until_a_rounding_near_tie(monkeypatch, fused):
    """Both decode paths: the compiled decode step (fused_decode.py; it takes all 16 sequences at once) and the
    model's forward with the compiled attention kernel (the step switched off)."""
    monkeypatch.setenv("VLLITE_CPU_BF16", "1")
    model_dir = str(make_tiny_model_dir_cached("llama", dtype="bfloat16", hidden_size=128, seed=3))
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(rng.randint(4, 40))] for _ in range(PROMPTS)]
    decode_calls = []
    original = cpu_attention.paged_decode_attention

    def counting(*args, **kwargs):
        result = original(*args, **kwargs)
        decode_calls.append(result is not None and result.dtype == torch.bfloat16)
        return result

    monkeypatch.setattr(cpu_attention, "paged_decode_attention", counting)
    with kernel_switch(monkeypatch, decode_step_kernel, "VLLITE_CPU_DECODE_STEP", on=fused):
        step_built = decode_step_kernel() is not None
        llm = LLM(model=model_dir, dtype="auto", max_model_len=256, device="cpu")
    runner = llm.llm_engine.engine_core.engine_core.model_executor.runner  # in-process (see tests/conftest.py)
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    fused_steps = count_fused_steps(runner)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    if step_built:  # fused, and the step builds here
        assert len(fused_steps) >= MAX_TOKENS - 1, "bfloat16 decode must run in the compiled step"
        assert not decode_calls
    elif not fused and cpu_decode.decode_kernel() is not None:  # built here and not switched off
        assert not fused_steps
        assert decode_calls and all(decode_calls), "bfloat16 decode must run in the compiled kernel"

    hf_bf16 = _hf_greedy(model_dir, prompts, torch.bfloat16)
    hf_fp32 = _hf_greedy(model_dir, prompts, torch.float32)
    agreed = 0
    for output, (hf_tokens, bf16_logits), (_, fp32_logits) in zip(outputs, hf_bf16, hf_fp32):
        ours = output.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(ours, hf_tokens)) if a != b), MAX_TOKENS)
        agreed += same
        if same < MAX_TOKENS:  # where the two bfloat16 runs part, HF must have faced a near-tie
            top2 = bf16_logits[same].topk(2).values
            margin = float(top2[0] - top2[1])
            assert margin <= NEAR_TIE * float(top2[0].abs()), f"diverged at step {same} on a clear choice: {top2}"
        fp32_logprobs = torch.log_softmax(fp32_logits, -1)
        hf32_tokens = fp32_logits.argmax(-1).tolist()
        for step, (token, lp) in enumerate(zip(ours, output.outputs[0].logprobs)):
            if token != hf32_tokens[step]:
                break  # past the first divergence from float32 the contexts differ
            assert abs(lp[token].logprob - float(fp32_logprobs[step, token])) < LOGPROB_TOL
    assert agreed >= 0.8 * PROMPTS * MAX_TOKENS, f"only {agreed} of {PROMPTS * MAX_TOKENS} tokens agree"
