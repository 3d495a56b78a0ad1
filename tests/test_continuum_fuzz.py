"""A seeded fuzz of the continuum scheduler: agent jobs with random turns, tool gaps (fake clock) and aborts over
a small KV cache. The base invariants and the pin invariants hold after every step, and once every job ended
(last step, or abandoned after an abort) and the pins expired, every block is free."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from vllite.policies.continuum import ContinuumScheduler
from vllite.policies.estimators import FixedTTLEstimator, UtilityEstimator
from vllite.request import Request, RequestStatus
from vllite.testing import ScriptedModelRunner, make_config, make_request

BS = 4
MAX_MODEL_LEN = 64
NUM_STEPS = 3000


@dataclass
class Job:
    job_id: str
    turns_left: int
    tokens: list[int]
    next_arrival: float | None = 0.0
    live: Request | None = None
    turn: int = 0
    done: bool = False
    history: list[str] = field(default_factory=list)


def check(s: ContinuumScheduler, so, budget: int) -> None:
    kv = s.kv_cache_manager
    counts = so.num_scheduled_tokens
    assert so.total_num_scheduled_tokens == sum(counts.values()) <= budget
    running = {r.request_id for r in s.running}
    waiting = {r.request_id for r in s.waiting}
    assert not running & waiting and running | waiting == set(s.requests)
    assert set(counts) <= running and not so.preempted_req_ids & set(counts)
    for r in s.waiting:
        assert r.num_computed_tokens == 0 and kv.get_block_ids(r.request_id) == []
    for r in s.running:
        assert len(kv.get_block_ids(r.request_id)) * BS >= r.num_computed_tokens
    # Pins: finished requests outside the scheduler's requests, one per job, holding their blocks.
    pins = s._pins
    pinned_ids = {pin.request.request_id for pin in pins.values()}
    assert len(pinned_ids) == len(pins) and not pinned_ids & set(s.requests)
    assert all(pin.request.is_finished() and pin.job_id == job for job, pin in pins.items())
    # Every reference on every block belongs to a running or pinned request.
    holders = Counter()
    for rid, blocks in kv.manager.req_to_blocks.items():
        if blocks:
            assert rid in running or rid in pinned_ids, rid
            holders.update(b.block_id for b in blocks if not b.is_null)
    for block in kv.block_pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0)
    assert kv.num_free_blocks == len(kv.block_pool.blocks) - 1 - len(holders)


@pytest.mark.parametrize("estimator", ["utility", "fixed"])
@pytest.mark.parametrize("release_on_admission", [True, False])
@pytest.mark.parametrize("release_before_preemption", [True, False])
def test_fuzz_continuum(estimator: str, release_on_admission: bool, release_before_preemption: bool) -> None:
    rng = random.Random(7 if estimator == "utility" else 11)
    budget = 24
    num_blocks = 1 + 16
    policy_args = {
        "release_pin_on_admission": release_on_admission,
        "release_pins_before_preemption": release_before_preemption,
        "cold_start_k": 5,
        "prefill_profile": [0.5, 0.05, 0.0],  # reloads look expensive: pins are frequent
        "max_jobs": 50,
    }
    config = make_config(
        max_num_batched_tokens=budget,
        max_num_seqs=5,
        max_model_len=MAX_MODEL_LEN,
        block_size=BS,
        policy_args=policy_args,
    )
    est = UtilityEstimator(config) if estimator == "utility" else FixedTTLEstimator(config)
    now = [0.0]
    s = ContinuumScheduler(config, num_blocks, clock=lambda: now[0], step_observer=None, estimator=est)
    ex = ScriptedModelRunner(choose=lambda rid, pos: rng.randrange(10, 500))
    tools = ["ls", "grep", "pytest", None]
    jobs: list[Job] = []
    next_job = 0
    seen = Counter()

    def start_turns(allow_new_jobs: bool) -> None:
        nonlocal next_job
        if allow_new_jobs and rng.random() < 0.12 and sum(not j.done for j in jobs) < 16:
            prompt = [rng.randrange(10, 500) for _ in range(rng.randrange(3, 10))]
            jobs.append(Job(f"j{next_job}", rng.randrange(1, 7), prompt, next_arrival=now[0]))
            next_job += 1
        for job in jobs:
            if job.done or job.live is not None or job.next_arrival is None or job.next_arrival > now[0]:
                continue
            new = [rng.randrange(10, 500) for _ in range(rng.randrange(1, 6))]
            prompt = job.tokens + new
            max_tokens = rng.randrange(1, 5)
            last = job.turns_left <= 1 or len(prompt) + max_tokens + 12 > MAX_MODEL_LEN
            args = {"job_id": job.job_id, "is_last_step": last}
            tool = rng.choice(tools)
            if tool is not None:
                args["this_func_call"] = tool
            rid = f"{job.job_id}-t{job.turn}"
            job.turn += 1
            job.live = make_request(s, rid, prompt, max_tokens=max_tokens, arrival_time=now[0], extra_args=args)
            job.turns_left -= 1
            s.add_request(job.live)

    def settle() -> None:
        for job in jobs:
            r = job.live
            if r is None or not r.is_finished():
                continue
            job.live = None
            if r.status == RequestStatus.FINISHED_ABORTED:
                job.done = True  # abandoned: its pin (if any) must expire
                seen["abandoned"] += 1
            elif r.extra["continuum"].is_last_step:
                job.done = True
            else:
                job.tokens = list(r.all_token_ids)
                gap = rng.expovariate(1.0) if rng.random() < 0.9 else rng.uniform(5, 20)
                job.next_arrival = now[0] + gap

    def one_step(allow_new_jobs: bool) -> None:
        start_turns(allow_new_jobs)
        if s.requests and rng.random() < 0.02:
            s.finish_requests(rng.choice(list(s.requests)), RequestStatus.FINISHED_ABORTED)
        so = s.schedule()
        check(s, so, budget)
        seen["preempted"] += len(so.preempted_req_ids)
        seen["hits"] += sum(n.num_computed_tokens > 0 for n in so.scheduled_new_reqs)
        s.update_from_output(so, ex.execute(so))
        settle()
        now[0] += rng.uniform(0.02, 0.3)

    for _ in range(NUM_STEPS):
        one_step(True)
    for _ in range(5000):
        if all(j.done for j in jobs):
            break
        one_step(False)
    assert all(j.done for j in jobs), "jobs did not finish: a deadlock"
    seen.update(s.pin_stats)
    assert seen["pinned"] > 50 and seen["hits"] > 50 and seen["preempted"] > 0 and seen["deadlock"] > 0, seen
    assert (seen["running_blocked"] > 0) == release_before_preemption, seen
    now[0] += 1000.0
    s.schedule()
    assert not s.requests and not s._pins
    assert s.kv_cache_manager.num_free_blocks == num_blocks - 1
    assert len(s._jobs) <= 50 + 8
