"""The per-step LoRA budget (``max_loras``) in the one token-budget algorithm, under every builtin policy.

A request whose adapter would be a new one beyond ``max_loras`` among the running requests is set aside for the
step without holding up the requests behind it; one reusing a running adapter (or none) is admitted. Nobody
starves: every request finishes, and no step ever runs more than ``max_loras`` distinct adapters.
"""

from __future__ import annotations

import dataclasses

import pytest

from vllite.lora import LoRAConfig, LoRARequest
from vllite.request import Request
from vllite.sched import create_scheduler
from vllite.testing import ScriptedModelRunner, make_config

POLICIES = ["fcfs", "priority", "continuum"]


def _scheduler(policy: str, max_loras: int, **config_kw):
    config = make_config(scheduling_policy=policy, **config_kw)
    config = dataclasses.replace(config, lora_config=LoRAConfig(max_loras=max_loras))
    return create_scheduler(config, 400)


def _add(scheduler, rid: str, lora_id: int | None, n_prompt: int = 6, max_tokens: int = 3) -> Request:
    lora = LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
    prompt = [100 + len(scheduler.requests) * 7 + i for i in range(n_prompt)]
    request = Request(rid, prompt, _params(max_tokens), lora_request=lora, block_hasher=scheduler.block_hasher)
    scheduler.add_request(request)
    return request


def _params(max_tokens: int):
    from vllite.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _adapters_of(scheduler, so) -> set[int]:
    return {
        scheduler.requests[rid].lora_request.lora_int_id
        for rid in so.num_scheduled_tokens
        if scheduler.requests[rid].lora_request is not None
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_a_new_adapter_beyond_the_budget_waits_while_reuse_and_base_are_admitted(policy: str) -> None:
    scheduler = _scheduler(policy, max_loras=2)
    for rid, lora in [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", None)]:
        _add(scheduler, rid, lora)
    so = scheduler.schedule()
    assert set(so.num_scheduled_tokens) == {"a", "b", "d", "e"}  # c's adapter would be the third
    assert _adapters_of(scheduler, so) == {1, 2}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


@pytest.mark.parametrize("policy", POLICIES)
def test_four_adapters_through_two_slots_all_finish_within_budget(policy: str) -> None:
    scheduler = _scheduler(policy, max_loras=2, max_num_batched_tokens=24)
    runner = ScriptedModelRunner()
    for i in range(16):
        _add(scheduler, f"r{i}", (i % 4) + 1 if i % 5 else None, n_prompt=4 + i % 7, max_tokens=2 + i % 4)
    finished: set[str] = set()
    for _ in range(200):
        if not scheduler.has_requests():
            break
        so = scheduler.schedule()
        assert len(_adapters_of(scheduler, so)) <= 2
        running = {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request is not None}
        assert len(running) <= 2
        outputs = scheduler.update_from_output(so, runner.execute(so))
        for engine_outputs in outputs.values():
            finished.update(o.request_id for o in engine_outputs.outputs if o.finish_reason is not None)
    assert finished == {f"r{i}" for i in range(16)}


def test_without_lora_config_adapters_are_not_counted() -> None:
    config = make_config()
    scheduler = create_scheduler(config, 400)
    for rid, lora in [("a", 1), ("b", 2), ("c", 3)]:
        _add(scheduler, rid, lora)
    assert set(scheduler.schedule().num_scheduled_tokens) == {"a", "b", "c"}
