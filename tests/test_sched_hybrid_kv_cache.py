"""The scheduler over a hybrid KV cache (``kv_cache_groups``): a sliding group returns its blocks while decoding,
the block ids the workers receive are interleaved and match the KV-cache manager's, and preemption by recompute
resumes a request with a fresh interleaved table."""

from __future__ import annotations

from tests.test_sched_sessions import build as build_sessions
from tests.test_sched_sessions import run_turn, session
from vllite.sched import Scheduler, SchedulerOutput, create_scheduler
from vllite.sched.async_scheduler import create_async_scheduler
from vllite.testing import ScriptedModelRunner, make_config, make_request

BS = 4


def build(groups: tuple[int | None, ...], num_blocks: int, **config_kw) -> Scheduler:
    return Scheduler(make_config(block_size=BS, **config_kw), num_blocks, step_observer=None, kv_cache_groups=groups)


class WorkerTables:
    """The block tables a worker keeps from the scheduler's outputs alone (what the model runner de-interleaves)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, so: SchedulerOutput) -> None:
        for request_id in so.finished_req_ids | so.preempted_req_ids:
            self.tables.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
        cached = so.scheduled_cached_reqs
        for request_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            self.tables[request_id].extend(new_ids or ())

    def check(self, s: Scheduler, groups: tuple[int | None, ...]) -> None:
        """Same length as the manager's run; equal ids, except where a sliding group has since released a block."""
        num_groups = len(groups)
        for request_id, table in self.tables.items():
            ids = s.kv_cache_manager.get_block_ids(request_id)
            assert len(table) == len(ids) and len(ids) % num_groups == 0
            for i, (sent, held) in enumerate(zip(table, ids)):
                assert sent == held or (held == 0 and groups[i % num_groups] is not None), (request_id, i)


def run(
    s: Scheduler,
    groups: tuple[int | None, ...],
    max_steps: int = 500,
    workers: WorkerTables | None = None,
    ex: ScriptedModelRunner | None = None,
) -> list[int]:
    """Steps until every request finished, checking the workers' tables; returns the pool blocks in use after
    each step."""
    held: list[int] = []
    ex, workers = ex or ScriptedModelRunner(), workers or WorkerTables()
    kv = s.kv_cache_manager
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        workers.apply(so)
        workers.check(s, groups)
        s.update_from_output(so, ex.execute(so))
        held.append(kv.num_blocks - 1 - kv.num_free_blocks)
    assert not s.has_unfinished_requests()
    return held


def test_a_sliding_group_holds_far_fewer_blocks_than_a_second_full_group() -> None:
    peaks = {}
    for groups in ((None, 8), (None, None)):
        s = build(groups, 1 + 64)
        assert s.kv_cache_manager.num_groups == 2
        s.add_request(make_request(s, "r", list(range(100, 120)), max_tokens=40))  # 59 tokens computed: 15 blocks
        held = run(s, groups)
        peaks[groups] = max(held)
        assert held[-1] == 0 and s.kv_cache_manager.block_pool.null_block.ref_cnt == 0
    assert peaks[(None, None)] == 30
    assert peaks[(None, 8)] <= 15 + 4  # the window (8 tokens) spans at most 3 blocks, plus the one filling


def test_block_ids_in_the_output_are_interleaved_and_match_the_manager() -> None:
    groups = (None, 8, 8)
    s = build(groups, 1 + 96, max_num_batched_tokens=16)
    for i, n in enumerate((21, 6, 13)):
        s.add_request(make_request(s, f"r{i}", list(range(100 * i, 100 * i + n)), max_tokens=12))
    so = s.schedule()  # chunked: r0 gets 16 tokens, 4 logical blocks of 3 groups
    workers, ex = WorkerTables(), ScriptedModelRunner()
    workers.apply(so)
    new = {n.req_id: n.block_ids for n in so.scheduled_new_reqs}
    assert new["r0"] == s.kv_cache_manager.get_block_ids("r0") and len(new["r0"]) == 4 * 3
    hybrid = s.kv_cache_manager.manager
    for g, manager in enumerate(hybrid.managers):
        assert new["r0"][g::3] == [b.block_id for b in manager.req_to_blocks["r0"]]
    s.update_from_output(so, ex.execute(so))
    run(s, groups, workers=workers, ex=ex)


def test_a_prefix_hit_is_interleaved_with_the_null_block_where_the_window_no_longer_reaches() -> None:
    groups = (None, 8)
    s = build(groups, 1 + 64)
    prompt = list(range(100, 120))  # 5 full blocks
    s.add_request(make_request(s, "a", prompt, max_tokens=1))
    run(s, groups)
    s.add_request(make_request(s, "b", [*prompt, 1, 2, 3], max_tokens=1))
    so = s.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 20 and so.num_scheduled_tokens == {"b": 3}
    # Token 20 attends to 13..20: the window needs blocks 3 and 4 only; full attention all five.
    assert [i for i, block_id in enumerate(new.block_ids) if block_id == 0] == [1, 3, 5]
    assert len(new.block_ids) == 6 * 2 and new.block_ids == s.kv_cache_manager.get_block_ids("b")


def test_preemption_resumes_with_a_fresh_interleaved_table() -> None:
    groups = (None, 8)
    # 12 usable blocks: two 7-token prompts take 4 each; decoding to 16 tokens needs 4 logical blocks each in the
    # full group plus the window's, more than both can hold at once.
    s = build(groups, 1 + 12)
    for rid in "AB":
        s.add_request(make_request(s, rid, list(range(ord(rid) * 100, ord(rid) * 100 + 7)), max_tokens=12))
    held = run(s, groups)
    assert s.num_preemptions_total > 0
    assert max(held) <= 12 and held[-1] == 0
    assert s.kv_cache_manager.manager.req_to_blocks == {}


def test_the_factories_pass_the_groups() -> None:
    config = make_config(block_size=BS)
    assert create_scheduler(config, 1 + 16, kv_cache_groups=(None, 8)).kv_cache_manager.num_groups == 2
    assert create_scheduler(config, 1 + 16).kv_cache_manager.num_groups == 1
    s = create_async_scheduler(config, 1 + 16, kv_cache_groups=(None, 8, 8))
    assert s.kv_cache_manager.num_groups == 3 and s.kv_cache_groups == (None, 8, 8)


def test_a_request_too_long_for_every_full_group_fails_instead_of_looping() -> None:
    # 9 usable blocks: a 16-token request needs 4 blocks per full group, 8 with two; with three groups 12.
    s = build((None, None, None), 1 + 9, max_model_len=64)
    request = make_request(s, "r", list(range(16)), max_tokens=4)
    s.add_request(request)
    run(s, (None, None, None), max_steps=50)
    assert request.is_finished() and request.error is not None and "cannot hold" in request.error


def test_a_held_session_gives_up_whole_logical_blocks_of_every_group() -> None:
    # Two full groups, 16 usable blocks: the parked session holds 3 positions (6 blocks), "big" needs 7 (14).
    s, _, ex = build_sessions(num_blocks=1 + 16, kv_cache_groups=(None, None))
    s.add_request(session(s, "parked", list(range(10, 20))))
    run_turn(s, ex, "parked")
    held = s.kv_cache_manager.get_block_ids("parked")
    s.add_request(session(s, "big", list(range(30, 50)), max_tokens=8, resumable=False))
    run_turn(s, ex, "big")
    assert s.num_preemptions_total == 0 and "parked" in s.session_holds
    assert s.kv_cache_manager.get_block_ids("parked") == held[:2]  # position 0 of both groups
    assert s.requests["parked"].num_computed_tokens == 4
    assert s.session_holds.num_blocks_released_for_memory == 4

    # With a sliding group no prefix is kept: the hold is released whole.
    s, _, ex = build_sessions(num_blocks=1 + 12, kv_cache_groups=(None, 8))
    s.add_request(session(s, "parked", list(range(10, 20))))
    run_turn(s, ex, "parked")
    s.add_request(session(s, "big", list(range(30, 50)), max_tokens=8, resumable=False))
    run_turn(s, ex, "big")
    assert "parked" not in s.session_holds and s.kv_cache_manager.get_block_ids("parked") == []
    assert s.requests["parked"].num_computed_tokens == 0 and s.session_holds.num_blocks_released_for_memory == 6
