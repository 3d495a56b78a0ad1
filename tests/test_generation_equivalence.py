"""The correctness oracle: greedy token ids equal Hugging Face ``generate()`` on the same tiny model.

Covered for several architectures: chunked prefill forced by a small token budget, prefix-cache hits from shared
prefixes, preemptions forced by a small KV cache, and batch size 1. Logprobs agree with HF's log_softmax.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from vllite import LLM, SamplingParams
from vllite.testing import make_tiny_model_dir_cached

ARCHS = ["llama", "qwen3", "mistral"]
MAX_TOKENS = 12


def _prompts(vocab_size: int, n: int = 16, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab_size) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(10, vocab_size) for _ in range(rng.randint(3, 60))] for _ in range(n)]


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0, bos_token_id=None
    )
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                generation_config=config,
                output_scores=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
            results.append((tokens, logprobs))
    return results


@pytest.fixture(scope="module", params=ARCHS)
def model_case(request):
    model_dir = str(make_tiny_model_dir_cached(request.param))
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = _prompts(vocab_size)
    return model_dir, prompts, _hf_greedy(model_dir, prompts, MAX_TOKENS)


def _generate(model_dir: str, prompts: list[list[int]], **engine_kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    engine_kwargs = {"max_model_len": 256, **engine_kwargs}
    llm = LLM(model_dir, dtype="float32", block_size=16, **engine_kwargs)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return llm, outputs
    finally:
        llm.shutdown()


def _assert_equal(outputs, expected, check_logprobs: bool = True):
    assert len(outputs) == len(expected)
    for i, (output, (hf_tokens, hf_logprobs)) in enumerate(zip(outputs, expected)):
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens, f"prompt {i}: {completion.token_ids} != HF {hf_tokens}"
        if check_logprobs:
            ours = [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)]
            assert ours == pytest.approx(hf_logprobs, abs=1e-4)


def test_chunked_prefill_small_budget(model_case):
    model_dir, prompts, expected = model_case
    _, outputs = _generate(model_dir, prompts, max_num_batched_tokens=24, max_num_seqs=8)
    _assert_equal(outputs, expected)


def test_batch_size_one(model_case):
    model_dir, prompts, expected = model_case
    _, outputs = _generate(model_dir, prompts[:4], max_num_seqs=1)
    _assert_equal(outputs, expected[:4])


def test_preemption_with_small_kv_cache(model_case):
    model_dir, prompts, expected = model_case
    # 12 blocks (one is the null block) hold one sequence of 176 tokens: max_model_len must fit it.
    llm, outputs = _generate(model_dir, prompts, num_gpu_blocks_override=12, max_num_seqs=16, max_model_len=176)
    _assert_equal(outputs, expected)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.num_preemptions_total > 0, "the small KV cache was meant to force preemptions"


def test_prefix_cache_hits():
    model_dir = str(make_tiny_model_dir_cached("llama"))
    from transformers import AutoConfig

    prompts = _prompts(AutoConfig.from_pretrained(model_dir).vocab_size, n=16, seed=3, shared_prefix=40)
    expected = _hf_greedy(model_dir, prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model_dir, dtype="float32", max_model_len=256, block_size=16, max_num_seqs=4) as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        second = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _assert_equal(first, expected, check_logprobs=False)
    _assert_equal(second, expected, check_logprobs=False)
    # Later requests of the first batch reuse the shared 40-token prefix (2 full blocks of 16)...
    assert sum(o.num_cached_tokens >= 32 for o in first) >= len(prompts) - 4
    # ...and in the second run every prompt's full blocks are cached.
    assert all(o.num_cached_tokens >= 32 for o in second)


@pytest.mark.skipif(os.environ.get("VLLITE_SKIP_MP_TESTS") == "1", reason="multiprocess tests disabled")
def test_multiprocess_engine_matches(model_case, monkeypatch):
    model_dir, prompts, expected = model_case
    pytest.importorskip("vllite.plugins.engine_proc.client")
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")
    _, outputs = _generate(model_dir, prompts, max_num_batched_tokens=24, num_gpu_blocks_override=14, max_model_len=208)
    _assert_equal(outputs, expected)


def test_pipelined_step_matches(model_case):
    """batch_queue_depth=2 schedules the next batch while one executes; outputs must not change."""
    model_dir, prompts, expected = model_case
    _, outputs = _generate(model_dir, prompts, max_num_batched_tokens=40, batch_queue_depth=2)
    _assert_equal(outputs, expected)
