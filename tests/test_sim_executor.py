"""The simulated executor: drives the real scheduler, advances a shared virtual clock by its cost model."""

from __future__ import annotations

import json

import pytest

from vllite.config import CacheConfig, EngineConfig, SchedulerConfig
from vllite.engine.core import EngineCore
from vllite.plugins.bench.sim_executor import (
    LLAMA_8B_KV_BYTES_PER_TOKEN,
    CostModel,
    SimClock,
    SimExecutor,
    step_load,
)
from vllite.protocol import EngineCoreRequest
from vllite.sampling_params import SamplingParams


def _config(
    num_gpu_blocks_override: int | None = None,
    max_num_batched_tokens: int = 64,
    scheduler_reserve_full_isl: bool = True,
    **sim: object,
) -> EngineConfig:
    return EngineConfig(
        cache_config=CacheConfig(block_size=16, num_gpu_blocks_override=num_gpu_blocks_override),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, scheduler_reserve_full_isl=scheduler_reserve_full_isl
        ),
        executor="sim",
        plugin_config={"sim": dict(sim)},
    )


def _request(request_id: str, prompt: list[int], max_tokens: int, at: float = 0.0) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, prompt, params, None, at)


def _drain(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.scheduler.has_requests():
        outputs, _ = core.step()
        for batch in outputs.values():
            for out in batch.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_sim_clock_only_moves_forward():
    clock = SimClock(5.0)
    assert clock() == 5.0
    assert clock.advance(1.5) == 6.5
    assert clock.advance_to(3.0) == 6.5  # never backwards
    assert clock.advance_to(10.0) == 10.0
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_cost_model_terms_and_fit():
    model = CostModel(fixed_s=0.01, per_token_s=0.001, per_context_token_s=1e-5)
    assert model.step_time(0, 100) == 0.0
    assert model.step_time(10, 1000) == pytest.approx(0.01 + 0.01 + 0.01)
    samples = [(n, c, model.step_time(n, c)) for n in (1, 8, 64, 512) for c in (100, 5000, 20000)]
    fitted = CostModel.fit(samples)
    assert fitted.fixed_s == pytest.approx(0.01, rel=1e-6)
    assert fitted.per_token_s == pytest.approx(0.001, rel=1e-6)
    assert fitted.per_context_token_s == pytest.approx(1e-5, rel=1e-6)
    with pytest.raises(ValueError):
        CostModel.from_dict({"fixed": 1.0})
    with pytest.raises(ValueError):
        CostModel(per_token_s=-1.0)


def test_cost_model_fit_clamps_negative_terms(tmp_path):
    # Step time independent of context: a noisy negative context term must come out as 0, not below.
    samples = [(n, c, 0.002 + 0.0001 * n - 1e-9 * (c % 7)) for n in (1, 10, 100) for c in (10, 2000, 9000)]
    fitted = CostModel.fit(samples)
    assert fitted.per_context_token_s == 0.0
    assert fitted.per_token_s == pytest.approx(0.0001, rel=0.01)
    profile = tmp_path / "profile.jsonl"
    profile.write_text(
        "".join(json.dumps({"num_tokens": n, "num_context_tokens": c, "seconds": s}) + "\n" for n, c, s in samples)
    )
    assert CostModel.from_profile(profile) == fitted


def test_sim_executor_drives_the_real_scheduler_on_the_virtual_clock():
    clock = SimClock()
    cost = {"fixed_s": 0.01, "per_token_s": 0.001, "per_context_token_s": 0.0001}
    config = _config(clock=clock, cost=cost, max_model_len=512, num_gpu_blocks_override=64)
    core = EngineCore(config)  # executor resolved by name: the plugin is registered
    assert isinstance(core.model_executor, SimExecutor)
    assert core.scheduler.clock is clock  # the scheduler shares the executor's virtual clock
    assert core.info.max_model_len == 512 and core.info.num_gpu_blocks == 64
    assert config.model_config.max_model_len is None  # what the engine settled on is reported, not written back
    core.add_request(_request("a", list(range(100)), max_tokens=5))
    core.add_request(_request("b", list(range(50, 90)), max_tokens=3))
    # Step 1: token budget 64 -> "a" gets a 64-token prefill chunk, "b" waits.
    outputs, executed = core.step()
    assert executed and not outputs
    assert clock() == pytest.approx(0.01 + 0.001 * 64 + 0.0001 * 64)
    before = clock()
    tokens = _drain(core)
    assert len(tokens["a"]) == 5 and len(tokens["b"]) == 3
    assert all(0 <= t < 32000 for ts in tokens.values() for t in ts)
    assert clock() > before
    assert core.model_executor.busy_time == pytest.approx(clock())
    core.shutdown()


def test_sim_tokens_are_reproducible_and_preemption_is_handled():
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        # Eager admission (no full-prompt gate): a third prompt starts in the room left and is preempted later.
        config = _config(
            max_model_len=256,
            seed=7,
            num_gpu_blocks_override=num_blocks,
            max_num_batched_tokens=256,
            scheduler_reserve_full_isl=False,
        )
        core = EngineCore(config)
        for i in range(6):
            core.add_request(_request(f"r{i}", [i] * 60 + list(range(40)), max_tokens=40))
        tokens = _drain(core)
        preemptions = core.scheduler.num_preemptions_total
        core.shutdown()
        return tokens, preemptions

    roomy, no_preemption = run(200)
    tight, preemptions = run(20)  # 20 blocks of 16 = 320 tokens for six 140-token requests
    assert no_preemption == 0 and preemptions > 0
    assert tight == roomy  # per-request seeded tokens: the same whatever the batching and preemptions


def test_kv_budget_from_simulated_memory_and_too_small_budget():
    config = _config(kv_cache_gib=1.0, max_model_len=4096)
    executor = SimExecutor(config)
    assert executor.initialize_kv_cache().num_blocks == (1 << 30) // (LLAMA_8B_KV_BYTES_PER_TOKEN * 16)
    config = _config(max_model_len=4096, num_gpu_blocks_override=10)
    with pytest.raises(ValueError, match="cannot hold one request"):
        SimExecutor(config).initialize_kv_cache()
    with pytest.raises(TypeError):
        SimExecutor(_config(clock=lambda: 0.0))


def test_step_load_counts_context_of_new_and_running_requests():
    core = EngineCore(_config(max_model_len=512, num_gpu_blocks_override=64))
    core.add_request(_request("a", list(range(30)), max_tokens=4))
    so = core.scheduler.schedule()
    assert step_load(so) == (30, 30)
    core.scheduler.update_from_output(so, core.model_executor.execute_model(so))
    so = core.scheduler.schedule()
    assert step_load(so) == (1, 31)  # one decode token attending to 31 tokens
    core.shutdown()
