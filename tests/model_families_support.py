"""Tiny random-weight checkpoints of the model families vllite runs, made from transformers' config classes (no
downloads), and Hugging Face ``generate()`` on them: the oracle of ``test_model_families.py`` and
``test_hybrid_kv_paths.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from vllite.testing.models import copy_demo_tokenizer

SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
MAX_TOKENS = 12

GQA = {**SMALL, "num_key_value_heads": 2, "head_dim": 16}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": GQA,
    "qwen3": GQA,
    "mistral": {**GQA, "sliding_window": 8},
    "gemma3_text": {**GQA, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "gemma2": {**GQA, "sliding_window": 8},  # alternating sliding and global layers, attention softcap
    "qwen2": {**GQA, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},  # full, then sliding
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


#: Families whose sliding-window and full-attention layers form two KV-cache groups (kv_cache_layout.py).
HYBRID = {"gemma2", "gemma3_text", "gpt_oss", "qwen2"}


def checkpoint(path: Path, model_type: str) -> str:
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


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist() for p in prompts]


def record_preemptions(scheduler: Any) -> set[str]:
    """A set that collects the ids of the requests ``scheduler`` preempts from now on."""
    preempted: set[str] = set()
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        preempted.update(output.preempted_req_ids)
        return output

    scheduler.schedule = recording_schedule
    return preempted
