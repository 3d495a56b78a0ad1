"""The model families vllite runs give Hugging Face's greedy tokens: dense (Llama, Qwen3), sliding windows (Mistral
with a window on every layer, Gemma 3 with sliding and global layers), MoE (Mixtral, Qwen3-MoE), and the attention
variants: gpt-oss (attention sinks on alternating sliding-window and full layers, MoE) and DeepSeek-V3 (multi-head
latent attention: keys and values of different head sizes, MoE).

Each family is a tiny random-weight checkpoint made here from transformers' own config class (no downloads), run in
float32 through ``LLM`` with a small KV cache (fewer sequences fit than are submitted: preemption), prefill chunks
of a few tokens, and prefix caching (a second batch of prompts sharing the first batch's prefixes hits the cache).
The oracle is ``generate()`` with transformers' eager attention.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from vllite import LLM, SamplingParams
from vllite.testing.models import copy_demo_tokenizer

SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
MAX_TOKENS = 12

GQA = {**SMALL, "num_key_value_heads": 2, "head_dim": 16}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": GQA,
    "qwen3": GQA,
    "mistral": {**GQA, "sliding_window": 8},
    "gemma3_text": {**GQA, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "mixtral": {**GQA, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**GQA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gpt_oss": {
        **SMALL,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,  # layer 0 slides, layer 1 attends to everything
    },
    "deepseek_v3": {
        **SMALL,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,  # keys 24 wide, values 8
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
    },
}


def _checkpoint(path: Path, model_type: str) -> str:
    copy_demo_tokenizer(path)
    config = AutoConfig.for_model(model_type, vocab_size=4096, max_position_embeddings=256, **FAMILIES[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 2.0)  # sinks large enough to change the result when ignored
    model.save_pretrained(path)
    return str(path)


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist() for p in prompts]


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Four prompts, and four more that share their first 16 tokens with them (prefix-cache hits)."""
    rng = random.Random(seed)
    first = [[rng.randrange(10, 4000) for _ in range(rng.randint(18, 30))] for _ in range(4)]
    second = [p[:16] + [rng.randrange(10, 4000) for _ in range(rng.randint(3, 9))] for p in first]
    return first, second


def _llm(model_dir: str, num_blocks: int, max_num_seqs: int = 4) -> LLM:
    return LLM(
        model_dir,
        dtype="float32",
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=8,  # prefills run in chunks of at most 8 tokens
        max_num_seqs=max_num_seqs,
        num_gpu_blocks_override=num_blocks,
    )


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_matches_hf_with_chunking_prefix_hits_and_preemption(tmp_path, model_type):
    model_dir = _checkpoint(tmp_path, model_type)
    first, second = _prompts(seed=len(model_type))
    expected = _hf_greedy(model_dir, first + second)

    # Room for every sequence: the second batch finds the first batch's prefixes in the cache.
    llm = _llm(model_dir, num_blocks=128)
    assert _greedy(llm, first) == expected[:4]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out_second = llm.generate([{"prompt_token_ids": p} for p in second], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out_second] == expected[4:]
    assert all(o.num_cached_tokens >= 8 for o in out_second)
    llm.llm_engine.shutdown()

    # 72 token slots for eight sequences of up to 42 tokens at once: requests are preempted and recomputed (also
    # with a sliding window, which holds about 4 blocks per sequence).
    llm = _llm(model_dir, num_blocks=18, max_num_seqs=8)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preempted: set[str] = set()
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        preempted.update(output.preempted_req_ids)
        return output

    scheduler.schedule = recording_schedule
    assert _greedy(llm, first + second) == expected
    # A window on every layer frees blocks as sequences advance, and admission waits for room: such a model may
    # never need to preempt (what is checked is the equality at a capacity for fewer sequences than submitted).
    assert preempted or model_type == "mistral"
