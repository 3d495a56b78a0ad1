"""The engine's other paths with a model whose sliding-window and full-attention layers form two KV-cache groups
(interleaved block tables, sliding blocks freed behind the window): n-gram speculative decoding, async scheduling,
an fp8 KV cache and sessions give the tokens they give with one group, and a KV connector is refused at start-up.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
from model_families_support import checkpoint, hf_greedy

from vllite import LLM, SamplingParams
from vllite.engine.llm_engine import LLMEngine
from vllite.engine_args import EngineArgs
from vllite.exceptions import ModelLoadError


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory) -> str:
    return checkpoint(Path(tmp_path_factory.mktemp("gemma3")), "gemma3_text")


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    # Repeated runs give the n-gram drafter something to propose.
    return [[rng.randrange(10, 4000) for _ in range(6)] * 4 for _ in range(3)]


def _greedy(model: str, **engine_kwargs) -> list[list[int]]:
    llm = LLM(model, dtype="float32", max_model_len=64, block_size=4, max_num_batched_tokens=16, **engine_kwargs)
    assert llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.num_groups == (
        1 if engine_kwargs.get("disable_hybrid_kv_cache_manager") else 2
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
        {"async_scheduling": True},
    ],
    ids=["ngram-spec-decode", "async-scheduling"],
)
def test_paths_with_two_groups_equal_hf(hybrid_model, engine_kwargs):
    assert _greedy(hybrid_model, **engine_kwargs) == hf_greedy(hybrid_model, _prompts())


def test_fp8_cache_with_two_groups_equals_one_group(hybrid_model):
    one_group = _greedy(hybrid_model, kv_cache_dtype="fp8", disable_hybrid_kv_cache_manager=True)
    assert _greedy(hybrid_model, kv_cache_dtype="fp8") == one_group


def test_a_session_with_two_groups_equals_its_stateless_turns(hybrid_model):
    """A parked session of a grouped model gives back its blocks (a sliding group keeps no prefix) and its next
    turn recomputes: each turn still equals the whole history sent as one prompt."""
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=hybrid_model, dtype="float32", max_model_len=128, block_size=4, enable_prefix_caching=False)
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        chunks = [list(range(100, 120)), list(range(300, 306)), list(range(500, 509))]
        engine.add_request("s", {"prompt_token_ids": chunks[0]}, params, resumable=True)
        turns: list[list[int]] = []
        contexts = [chunks[0]]
        while True:
            outputs = [o for o in engine.step() if o.outputs[0].finish_reason is not None]
            if outputs and outputs[-1].finished:
                break
            for output in outputs:
                turns.append(list(output.outputs[0].token_ids))
                if len(turns) < len(chunks):
                    contexts.append(contexts[-1] + turns[-1] + chunks[len(turns)])
                    engine.add_session_input("s", {"prompt_token_ids": chunks[len(turns)]}, params)
                else:
                    engine.close_session_input("s")
        assert turns == hf_greedy(hybrid_model, contexts, 5)
    finally:
        engine.shutdown()


def test_a_kv_connector_is_refused_with_two_groups_and_served_with_one(hybrid_model, tmp_path):
    offload = {"kv_offload_size": 0.01}
    with pytest.raises(ModelLoadError, match="--disable-hybrid-kv-cache-manager"):
        LLM(hybrid_model, dtype="float32", max_model_len=64, block_size=4, **offload)
    _greedy(hybrid_model, disable_hybrid_kv_cache_manager=True, **offload)


def test_the_start_up_report_names_the_groups(hybrid_model, caplog, monkeypatch):
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    caplog.set_level(logging.INFO, logger="vllite.engine.core")
    LLM(hybrid_model, dtype="float32", max_model_len=64, block_size=4, num_gpu_blocks_override=40).llm_engine.shutdown()
    assert "KV cache: 40 blocks in 2 groups (windows [None, 8]) / 160 tokens" in caplog.text
