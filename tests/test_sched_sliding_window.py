"""Sliding-window models: the scheduler frees blocks that fall out of the window, and greedy generation through the
engine still equals Hugging Face ``generate()`` (which masks by the same window)."""

from __future__ import annotations

import pytest

from vllite.sched import Scheduler, create_scheduler
from vllite.testing import ScriptedModelRunner, make_config, make_request

BS = 4


def test_blocks_outside_the_window_return_to_the_pool_as_decoding_proceeds() -> None:
    s = Scheduler(make_config(block_size=BS), 1 + 64, step_observer=None, sliding_window=8)
    ex = ScriptedModelRunner()
    request = make_request(s, "r", list(range(100, 120)), max_tokens=40)  # 20 prompt tokens = 5 blocks
    s.add_request(request)
    kv = s.kv_cache_manager
    held = []
    while not request.is_finished():
        so = s.schedule()
        s.update_from_output(so, ex.execute(so))
        held.append(64 - kv.num_free_blocks)
    # Position p attends to p-7..p: at most 3 blocks (plus the one being filled) are ever held, while full
    # attention would hold all 15 blocks of the 59 tokens computed.
    assert max(held[1:]) <= 4 and held[-1] == 0
    assert kv.block_pool.null_block.ref_cnt == 0


def test_without_a_window_every_block_is_kept() -> None:
    s = create_scheduler(make_config(block_size=BS), 1 + 64)
    assert s.kv_cache_manager.sliding_window is None
    ex = ScriptedModelRunner()
    s.add_request(make_request(s, "r", list(range(100, 120)), max_tokens=20))
    for _ in range(10):
        so = s.schedule()
        s.update_from_output(so, ex.execute(so))
    assert 64 - s.kv_cache_manager.num_free_blocks == 8  # 29 tokens computed, all blocks kept


def test_factory_passes_the_window() -> None:
    s = create_scheduler(make_config(block_size=BS), 1 + 16, sliding_window=8)
    assert s.kv_cache_manager.sliding_window == 8


def _config(name: str, **kw):
    import transformers

    return getattr(transformers, name)(num_hidden_layers=4, **kw)


@pytest.mark.parametrize(
    ("name", "overrides", "expected"),
    [
        ("MistralConfig", {"sliding_window": 8}, 8),
        ("MistralConfig", {"sliding_window": None}, None),
        ("LlamaConfig", {}, None),
        ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, 8),
        ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}, None),
        ("Qwen2Config", {"use_sliding_window": False, "sliding_window": 8}, None),
        ("Gemma2Config", {"sliding_window": 8}, None),  # alternates sliding and global layers
        (
            "Gemma3TextConfig",
            {"sliding_window": 8, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
            None,
        ),
    ],
)
def test_uniform_sliding_window(name: str, overrides: dict, expected: int | None) -> None:
    from vllite.plugins.transformers_executor.model_loader import uniform_sliding_window

    assert uniform_sliding_window(_config(name, **overrides)) == expected


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int, **config_overrides) -> list[list[int]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir, **config_overrides)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist() for p in prompts]


def test_sliding_window_model_matches_hf_and_frees_blocks() -> None:
    import random

    from vllite import LLM, SamplingParams
    from vllite.testing import make_tiny_model_dir_cached

    window, max_tokens = 8, 24
    model_dir = str(make_tiny_model_dir_cached("mistral", sliding_window=window))
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 200) for _ in range(rng.randint(12, 40))] for _ in range(6)]
    expected = _hf_greedy(model_dir, prompts, max_tokens)
    # The window matters for these prompts: HF without it generates something else.
    assert expected != _hf_greedy(model_dir, prompts, max_tokens, sliding_window=None)

    llm = LLM(model_dir, dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=32)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    assert kv.sliding_window == window
    freed: list[int] = []
    free_blocks = kv.block_pool.free_blocks

    def counting_free(blocks):
        blocks = list(blocks)
        freed.append(len(blocks))
        free_blocks(blocks)

    kv.block_pool.free_blocks = counting_free
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    # Blocks left the window while requests were running (not only when they finished).
    assert kv.manager.req_to_blocks == {} and kv.num_free_blocks == kv.num_blocks - 1
    window_frees = [n for n in freed if n]
    assert len(window_frees) > len(prompts)
