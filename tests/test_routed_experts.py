"""``--enable-return-routed-experts``: a MoE model's finished outputs carry the top-k expert ids of every computed
position and MoE layer, equal to what Hugging Face's routers pick over the whole sequence, also for positions read
from prefix-cache hits, under chunked prefill and after preemption."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from model_families_support import checkpoint, record_preemptions
from transformers import AutoModelForCausalLM

from vllite import LLM, SamplingParams
from vllite.exceptions import ModelLoadError
from vllite.plugins.transformers_executor.routed_experts import find_routers

MAX_TOKENS = 6


def _hf_routing(model_dir: str, sequence: list[int]) -> np.ndarray:
    """``[positions, moe_layers, top_k]``: the expert ids HF's routers pick for ``sequence`` in one forward."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    picked: list[torch.Tensor] = []
    for router in find_routers(model):
        router.register_forward_hook(lambda module, args, output: picked.append(output[2]))
    with torch.no_grad():
        model(torch.tensor([sequence]))
    return torch.stack(picked, dim=1).numpy()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    return checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral")


def _llm(model: str, **kwargs) -> LLM:
    return LLM(
        model,
        dtype="float32",
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=8,
        enable_return_routed_experts=True,
        **kwargs,
    )


def test_routed_experts_equal_hf_routers_with_chunks_prefix_hits_and_preemption(mixtral):
    rng = random.Random(5)
    first = [[rng.randrange(10, 4000) for _ in range(rng.randint(14, 22))] for _ in range(4)]
    second = [p[:12] + [rng.randrange(10, 4000) for _ in range(5)] for p in first]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Room for all: the second prompts' first 12 positions are prefix-cache hits, read from the cached slots.
    llm = _llm(mixtral, num_gpu_blocks_override=128)
    outputs = llm.generate([{"prompt_token_ids": p} for p in first], params, use_tqdm=False)
    hits = llm.generate([{"prompt_token_ids": p} for p in second], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 8 for o in hits)
    llm.llm_engine.shutdown()
    # Too little room for all eight at once: requests are preempted and recompute (their routing again from 0).
    llm = _llm(mixtral, num_gpu_blocks_override=17, max_num_seqs=8, scheduler_reserve_full_isl=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preempted = record_preemptions(scheduler)
    tight = llm.generate([{"prompt_token_ids": p} for p in first + second], params, use_tqdm=False)
    assert preempted
    for prompt, output in zip(first + second + first + second, outputs + hits + tight, strict=True):
        completion = output.outputs[0]
        sequence = prompt + list(completion.token_ids)[:-1]  # the last token is sampled, never computed
        routed = completion.routed_experts
        assert routed is not None and routed.dtype == np.int16 and routed.shape == (len(sequence), 2, 2)
        assert np.array_equal(np.sort(routed, axis=-1), np.sort(_hf_routing(mixtral, sequence), axis=-1))


def test_without_the_flag_nothing_is_returned(mixtral):
    llm = LLM(mixtral, dtype="float32", max_model_len=64, block_size=4)
    output = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert output.outputs[0].routed_experts is None


def test_a_model_without_routers_and_speculation_are_refused(tmp_path, mixtral):
    with pytest.raises(ModelLoadError, match="needs a MoE model with top-k routers; LlamaForCausalLM has none"):
        _llm(checkpoint(tmp_path, "llama"))
    with pytest.raises(ValueError, match="--enable-return-routed-experts cannot be combined with --speculative"):
        _llm(mixtral, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
