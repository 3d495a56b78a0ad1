"""The compiled CPU decode step (vllite.kernels.cpu_decode_step through plugins/transformers_executor/fused_decode.py):
the decode steps of Llama, Qwen2 (with Q/K/V biases) and Mistral models give Hugging Face ``generate()``'s greedy tokens
and logprobs; batches it does not take, models it does not know and engines it does not fit (fp8 cache, LoRA) run
the model's forward; a deep sleep lets go of the weights it holds."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernel_support import assert_kernel_builds, count_fused_steps, kernel_switch
from vllite import LLM, SamplingParams
from vllite.kernels.cpu_decode_step import decode_step_kernel
from vllite.plugins.transformers_executor.fused_decode import FusedDecoder
from vllite.testing import make_tiny_model, make_tiny_model_dir_cached

needs_step = pytest.mark.skipif(decode_step_kernel() is None, reason="the decode step could not be built here")

MAX_TOKENS = 20
#: Logprob agreement with HF float32 where both chose the same token: only summation order differs.
LOGPROB_TOL = 2e-4


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_executor.runner  # in-process (VLLITE_ENABLE_MULTIPROCESSING=0)


def _with_random_biases(folder) -> None:
    """Gives the Q, K and V projections non-zero biases (transformers initialises them to zero)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.copy_(torch.randn(proj.bias.shape, generator=generator) * 0.5)
    model.save_pretrained(folder)


def _hf_greedy(folder, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens for ``prompt`` and the log-softmax of its logits at each step."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), generation_config=config, output_scores=True, return_dict_in_generate=True
        )
    logprobs = torch.log_softmax(torch.stack([s[0].float() for s in out.scores]), -1)
    return out.sequences[0, len(prompt) :].tolist(), logprobs


def _assert_matches_hf(folder, prompts, outputs, max_tokens) -> None:
    for prompt, output, limit in zip(prompts, outputs, max_tokens, strict=True):
        hf_tokens, hf_logprobs = _hf_greedy(folder, prompt, limit)
        ours = output.outputs[0]
        assert list(ours.token_ids) == hf_tokens
        for step, (token, logprobs) in enumerate(zip(ours.token_ids, ours.logprobs, strict=True)):
            assert abs(logprobs[token].logprob - float(hf_logprobs[step, token])) < LOGPROB_TOL


@needs_step
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_decode_steps_give_hf_greedy_tokens_and_logprobs(tmp_path, arch):
    folder = make_tiny_model(arch, tmp_path / arch, hidden_size=128, num_heads=4, num_kv_heads=2, seed=5)
    if arch == "qwen2":
        _with_random_biases(folder)
    rng = random.Random(1)
    # Prompts across block boundaries (16-token blocks) and a batch that shrinks as requests finish.
    prompts = [[rng.randrange(10, 500) for _ in range(rng.randint(3, 45))] for _ in range(6)]
    max_tokens = [MAX_TOKENS - 3 * i for i in range(len(prompts))]
    with LLM(str(folder), max_model_len=256, device="cpu") as llm:
        runner = _runner(llm)
        assert isinstance(runner.fused_decoder, FusedDecoder)
        served = count_fused_steps(runner)
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in max_tokens]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(served) >= MAX_TOKENS - 1 and max(served) > 1 and min(served) == 1
    _assert_matches_hf(folder, prompts, outputs, max_tokens)


@needs_step
def test_batches_wider_than_the_step_run_the_model_forward(tmp_path):
    """18 sequences decode through the model's forward (the float32 step takes 16) until enough have finished."""
    folder = make_tiny_model("llama", tmp_path / "m", seed=2)
    rng = random.Random(2)
    prompts = [[rng.randrange(10, 500) for _ in range(rng.randint(3, 20))] for _ in range(18)]
    max_tokens = [3 + i for i in range(len(prompts))]
    with LLM(str(folder), max_model_len=128, device="cpu") as llm:
        runner = _runner(llm)
        assert runner.fused_decoder.max_rows == 16
        served = count_fused_steps(runner)
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in max_tokens]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert served and max(served) == 16
    _assert_matches_hf(folder, prompts, outputs, max_tokens)


@needs_step
@pytest.mark.parametrize(
    ("arch", "model_args", "engine_args"),
    [
        ("gemma", {}, {}),  # another decoder layer (scaled embeddings, GELU, offset norms)
        ("mistral", {"sliding_window": 4}, {}),  # the window is read off the config at each call
        ("llama", {}, {"kv_cache_dtype": "fp8"}),  # the step writes the cache in the model's dtype only
        ("llama", {}, {"enable_lora": True, "max_lora_rank": 8}),  # adapters are applied inside the modules
    ],
)
def test_engines_the_step_does_not_fit_run_the_model_forward(arch, model_args, engine_args):
    folder = str(make_tiny_model_dir_cached(arch, **model_args))
    with LLM(folder, max_model_len=128, device="cpu", **engine_args) as llm:
        assert _runner(llm).fused_decoder is None
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@needs_step
def test_a_deep_sleep_lets_go_of_the_step_and_waking_builds_it_again():
    folder = str(make_tiny_model_dir_cached("llama", seed=6))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [9, 8, 7, 6]}]
    with LLM(folder, max_model_len=128, device="cpu", enable_sleep_mode=True) as llm:
        runner = _runner(llm)
        before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        llm.sleep(level=2)
        assert runner.fused_decoder is None
        llm.wake_up()
        assert isinstance(runner.fused_decoder, FusedDecoder)
        served = count_fused_steps(runner)
        after = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before and len(served) == 5


def test_switched_off_the_model_forward_serves_every_step(monkeypatch):
    folder = str(make_tiny_model_dir_cached("llama"))
    with (
        kernel_switch(monkeypatch, decode_step_kernel, "VLLITE_CPU_DECODE_STEP", on=False),
        LLM(folder, max_model_len=128, device="cpu") as llm,
    ):
        assert _runner(llm).fused_decoder is None


def test_the_step_builds_where_there_is_a_compiler(monkeypatch):
    assert_kernel_builds(monkeypatch, decode_step_kernel, "VLLITE_CPU_DECODE_STEP")
