"""A seeded fuzz of the scheduler: random arrivals, aborts, stops, drafts and a small KV cache, with the
invariants checked after every step."""

from __future__ import annotations

import random

import pytest

from vllite.policies.fcfs import FCFSScheduler
from vllite.policies.priority import PriorityScheduler
from vllite.request import RequestStatus
from vllite.sched import Scheduler
from vllite.testing import ScriptedModelRunner, make_config, make_request

NUM_STEPS = 10_000
BLOCK_SIZE = 4
MAX_MODEL_LEN = 48
EOS = 3


def check_invariants(s: Scheduler, so, budget: int) -> None:
    kv = s.kv_cache_manager
    counts = so.num_scheduled_tokens
    assert so.total_num_scheduled_tokens == sum(counts.values()) <= budget
    assert all(n > 0 for n in counts.values())
    assert len(s.running) <= s.max_num_running_reqs
    running_ids = [r.request_id for r in s.running]
    waiting_ids = [r.request_id for r in s.waiting]
    assert len(set(running_ids)) == len(running_ids) and len(set(waiting_ids)) == len(waiting_ids)
    assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
    assert set(running_ids) | set(waiting_ids) == set(s.requests)
    assert set(counts) <= set(running_ids)
    assert not so.preempted_req_ids & set(counts)
    for r in s.running:
        assert r.status == RequestStatus.RUNNING
        # Blocks for every computed token (the counters already include this step's tokens).
        assert len(kv.get_block_ids(r.request_id)) * BLOCK_SIZE >= r.num_computed_tokens
        assert r.num_computed_tokens <= min(
            r.num_tokens + len(so.scheduled_spec_decode_tokens.get(r.request_id, ())), MAX_MODEL_LEN
        )
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0 and kv.get_block_ids(r.request_id) == []
    for rid, drafts in so.scheduled_spec_decode_tokens.items():
        assert 0 < len(drafts) < counts[rid]


@pytest.mark.parametrize("cls", [FCFSScheduler, PriorityScheduler])
def test_fuzz_invariants(cls: type[Scheduler]) -> None:
    rng = random.Random(1234)
    budget = 24
    num_blocks = 1 + 20  # 80 token slots: a few requests at a time, preemption is frequent
    config = make_config(
        max_num_batched_tokens=budget,
        max_num_seqs=6,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        long_prefill_token_threshold=rng.choice([0, 8]),
    )
    s = cls(config, num_blocks, step_observer=None)
    prefixes = [[rng.randrange(10, 500) for _ in range(12)] for _ in range(4)]
    ex = ScriptedModelRunner(
        choose=lambda rid, pos: EOS if rng.random() < 0.03 else rng.randrange(10, 500),
        accept=lambda rid, drafts: rng.randrange(len(drafts) + 1),
    )
    seen_preemption = seen_hit = 0
    next_id = 0
    for _ in range(NUM_STEPS):
        if rng.random() < 0.3:
            n = rng.randrange(1, 30)
            tokens = (
                (rng.choice(prefixes) + [rng.randrange(10, 500) for _ in range(n)])[:n]
                if rng.random() < 0.5
                else [rng.randrange(10, 500) for _ in range(n)]
            )
            request = make_request(
                s,
                f"r{next_id}",
                tokens,
                eos_token_id=EOS,
                priority=rng.randrange(3),
                arrival_time=float(next_id),
                max_tokens=rng.randrange(1, 20),
                ignore_eos=rng.random() < 0.2,
            )
            next_id += 1
            s.add_request(request)
        if s.requests and rng.random() < 0.05:
            s.finish_requests(rng.choice(list(s.requests)), RequestStatus.FINISHED_ABORTED)
        if rng.random() < 0.3:
            drafts = {r.request_id: [rng.randrange(10, 500) for _ in range(rng.randrange(1, 4))] for r in s.running}
            s.update_draft_token_ids(drafts)
        so = s.schedule()
        check_invariants(s, so, budget)
        seen_preemption += len(so.preempted_req_ids)
        seen_hit += any(n.num_computed_tokens > 0 for n in so.scheduled_new_reqs)
        s.update_from_output(so, ex.execute(so))
        assert set(r.request_id for r in s.running) | set(r.request_id for r in s.waiting) == set(s.requests)
    assert seen_preemption > 50 and seen_hit > 50

    # Drain: everything ends, every block is free again.
    for _ in range(2000):
        if not s.has_requests():
            break
        so = s.schedule()
        check_invariants(s, so, budget)
        s.update_from_output(so, ex.execute(so))
    assert not s.has_requests(), "requests did not finish: a deadlock"
    assert not s.requests and not s.running and not s.waiting
    assert s.kv_cache_manager.num_free_blocks == num_blocks - 1
