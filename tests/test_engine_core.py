"""The in-process EngineCore: stepping, aborts, pause modes, prefix-cache reset, sleep, executor failure."""

from __future__ import annotations

import pytest

from vllite.config import CacheConfig, EngineConfig, ModelConfig
from vllite.engine.core import EngineCore
from vllite.exceptions import ModelExecutionError
from vllite.plugins.inprocess_client.client import InprocClient
from vllite.protocol import EngineCoreRequest, FinishReason
from vllite.sampling_params import SamplingParams

FAKE = "vllite.testing.executors:PositionTokenExecutor"


def make_core(enable_sleep_mode: bool = False, **fake_options) -> EngineCore:
    config = EngineConfig(
        model_config=ModelConfig(max_model_len=256, enable_sleep_mode=enable_sleep_mode),
        cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=64),
        executor=FAKE,
        plugin_config={"fake_executor": fake_options},
    )
    return EngineCore(config)


def request(request_id: str, prompt_len: int = 6, max_tokens: int = 4) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, list(range(10, 10 + prompt_len)), params, None, 0.0)


def run_to_completion(core: EngineCore, max_steps: int = 100) -> dict[str, list]:
    tokens: dict[str, list] = {}
    reasons: dict[str, FinishReason] = {}
    for _ in range(max_steps):
        outputs, _ = core.step()
        for output in outputs.get(0).outputs if outputs.get(0) else []:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                reasons[output.request_id] = output.finish_reason
        if not core.scheduler.has_requests():
            break
    return {"tokens": tokens, "reasons": reasons}


def test_step_runs_requests_to_completion():
    core = make_core()
    core.add_request(request("a", 6, 3))
    core.add_request(request("b", 9, 2))
    result = run_to_completion(core)
    assert result["tokens"] == {"a": [1006, 1007, 1008], "b": [1009, 1010]}
    assert result["reasons"] == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    core.shutdown()


def test_duplicate_request_id_rejected():
    core = make_core()
    core.add_request(request("a"))
    with pytest.raises(ValueError, match="already"):
        core.add_request(request("a"))


def test_abort_waiting_and_running():
    core = make_core()
    core.add_request(request("run", 4, 50))
    core.step()
    core.add_request(request("wait", 4, 50))
    core.abort_requests(["run", "wait", "unknown"])
    # Aborts come from the client, which already knows: they are only reported in finished_requests.
    outputs, _ = core.step()
    assert {"run", "wait"} <= (outputs[0].finished_requests or set())
    assert not core.scheduler.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.usage == 0.0


def test_pause_keep_freezes_and_resume_continues():
    core = make_core()
    core.add_request(request("a", 4, 6))
    core.step()
    core.pause_scheduler("keep")
    assert core.is_scheduler_paused()
    for _ in range(3):
        _, executed = core.step()
        assert not executed
    core.resume_scheduler()
    result = run_to_completion(core)
    assert len(result["tokens"]["a"]) == 5  # one token came before the pause


def test_pause_abort_aborts_everything():
    core = make_core()
    core.add_request(request("a", 4, 6))
    core.add_request(request("b", 4, 6))
    core.step()
    core.pause_scheduler("abort")
    assert core.scheduler.get_num_unfinished_requests() == 0
    with pytest.raises(ValueError, match="pause mode"):
        core.pause_scheduler("later")


def test_reset_prefix_cache_and_sleep():
    core = make_core(enable_sleep_mode=True)
    core.add_request(request("a", 12, 2))
    run_to_completion(core)
    assert core.reset_prefix_cache()
    core.sleep(1)
    assert core.is_sleeping()
    core.wake_up()
    assert not core.is_sleeping()
    with pytest.raises(ValueError, match="sleep level"):
        core.sleep(5)


def test_executor_failure_surfaces_as_error():
    core = make_core(fail_at_step=2)
    core.add_request(request("a", 4, 5))
    core.step()
    with pytest.raises(ModelExecutionError, match="injected failure"):
        core.step()


def test_inproc_client_utility_allow_list():
    client = InprocClient(EngineConfig(model_config=ModelConfig(max_model_len=128), executor=FAKE))
    assert client.call_utility("is_scheduler_paused") is False
    with pytest.raises(ValueError, match="disallowed"):
        client.call_utility("shutdown")
    client.add_request(request("x", 4, 2))
    seen = []
    while len(seen) < 2:
        seen.extend(t for o in client.get_output().outputs for t in o.new_token_ids)
    assert seen == [1004, 1005]
    client.shutdown()


def test_the_start_up_heap_is_frozen_until_shutdown():
    """Full collections skip the start-up heap while the engine serves (no 100-200 ms pauses); shutdown gives it
    back to the collector."""
    import gc

    core = make_core()
    try:
        assert gc.get_freeze_count() > 0
        core.add_request(request("r"))
        assert run_to_completion(core)["reasons"] == {"r": FinishReason.LENGTH}
    finally:
        core.shutdown()
    assert gc.get_freeze_count() == 0
