"""The ``continuum`` scheduler with the ScriptedModelRunner and a fake clock: pinning, every release path, queue order,
victim choice with refund, deadlock release, and the released fork's known bugs as regression tests."""

from __future__ import annotations

import pytest

from vllite import plugin_manager
from vllite.policies.continuum import ContinuumScheduler
from vllite.policies.continuum_queue import ContinuumRequestQueue
from vllite.policies.estimators import FixedTTLEstimator, UtilityEstimator
from vllite.request import Request, RequestStatus
from vllite.sched import create_scheduler
from vllite.testing import ScriptedModelRunner, make_config, make_request

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ConstTTL:
    """An estimator returning a fixed TTL, recording what it was told."""

    def __init__(self, ttl: float = 5.0) -> None:
        self.ttl = ttl
        self.arrived: list[tuple[str, float]] = []
        self.finished: list[tuple[str, float, str | None]] = []
        self.waits: list[float] = []

    def request_arrives(self, request: Request, now: float) -> None:
        self.arrived.append((request.request_id, now))

    def request_finished(self, request: Request, now: float) -> None:
        from vllite.policies.continuum_turns import turn_info

        self.finished.append((request.request_id, now, turn_info(request).this_func_call))

    def set_up_pin(self, request: Request, now: float) -> float:
        return self.ttl

    def record_queueing_delay(self, seconds: float) -> None:
        self.waits.append(seconds)


def build(num_blocks: int = 64, ttl: float = 5.0, estimator=None, policy_args=None, **config_kw):
    config_kw.setdefault("block_size", BS)
    config = make_config(policy_args=policy_args, **config_kw)
    clock = Clock()
    est = estimator if estimator is not None else ConstTTL(ttl)
    s = ContinuumScheduler(config, num_blocks, clock=clock, step_observer=None, estimator=est, tool_parser=None)
    return s, clock, est


def add(s, rid: str, tokens: list[int], job: str | None = "J", *, max_tokens: int = 2, arrival: float = 0.0, **extra):
    args = dict(extra)
    if job is not None:
        args["job_id"] = job
    request = make_request(s, rid, tokens, max_tokens=max_tokens, arrival_time=arrival, extra_args=args)
    s.add_request(request)
    return request


def step(s, ex):
    so = s.schedule()
    s.update_from_output(so, ex.execute(so))
    return so


def run_until_done(s, ex, *requests, limit: int = 50):
    for _ in range(limit):
        if all(r.is_finished() for r in requests):
            return
        step(s, ex)
    raise AssertionError("requests did not finish")


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def free_usable(s) -> int:
    return s.kv_cache_manager.num_free_blocks


# ---------------------------------------------------------------------- pinning
def test_finished_turn_is_pinned_until_ttl_and_next_turn_hits_its_blocks():
    s, clock, _ = build(ttl=5.0)
    ex = ScriptedModelRunner()
    t1 = add(s, "t1", toks(100, 11))  # 11 prompt + 2 output: 12 tokens in KV = 3 full blocks
    run_until_done(s, ex, t1)
    assert t1.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert "t1" not in s.requests
    assert s.pinned_jobs == {"J": 5.0}
    assert len(s.kv_cache_manager.get_block_ids("t1")) == 3
    assert free_usable(s) == 63 - 3
    assert s.num_pinned_blocks == 3
    t1_blocks = s.kv_cache_manager.get_block_ids("t1")

    clock.now = 1.0  # the tool ran for 1 s
    t2 = add(s, "t2", t1.all_token_ids + toks(900, 5))
    so = s.schedule()
    # the 3 full pinned blocks hit through the prefix cache
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    assert so.num_scheduled_tokens == {"t2": 18 - 12}
    # default: admission of the next turn releases the pin; the shared blocks stay with t2
    assert s.pinned_jobs == {}
    assert s.pin_stats["admitted"] == 1
    assert so.scheduled_new_reqs[0].block_ids[:3] == t1_blocks
    s.update_from_output(so, ex.execute(so))
    run_until_done(s, ex, t2)


def test_ttl_expiry_is_inclusive_and_releases_the_blocks_at_step_start():
    s, clock, _ = build(ttl=2.0)
    ex = ScriptedModelRunner()
    t1 = add(s, "t1", toks(100, 10))
    run_until_done(s, ex, t1)
    clock.now = 1.999
    s.schedule()
    assert "J" in s.pinned_jobs
    clock.now = 2.0
    s.schedule()
    assert s.pinned_jobs == {} and s.pin_stats["expired"] == 1
    assert free_usable(s) == 63
    assert s.kv_cache_manager.get_block_ids("t1") == []


def test_expired_pin_is_kept_while_its_job_has_a_request_waiting():
    # One request at a time: while another job runs, J's next turn waits and its expired pin must stay.
    s, clock, _ = build(ttl=1.0, max_num_seqs=1, policy_args={"release_pin_on_admission": False})
    ex = ScriptedModelRunner()
    t1 = add(s, "t1", toks(100, 6))
    run_until_done(s, ex, t1)
    hog = add(s, "hog", toks(500, 6), job=None, max_tokens=10)
    step(s, ex)
    t2 = add(s, "t2", [*t1.all_token_ids, 9], max_tokens=1)
    clock.now = 5.0
    step(s, ex)
    assert "J" in s.pinned_jobs and s.waiting.has_job("J")
    run_until_done(s, ex, hog)
    step(s, ex)  # t2 admitted (and finished) this step; the expired pin goes at the next step start
    assert t2.is_finished()
    clock.now = 7.0
    s.schedule()
    # t1's pin outlived its TTL until t2's pin replaced it; t2's pin then expired
    assert s.pinned_jobs == {} and s.pin_stats["replaced"] == 1 and s.pin_stats["expired"] == 1
    assert free_usable(s) == 63


def test_newer_pin_releases_the_older_one_and_keeps_shared_blocks():
    s, _clock, _ = build(ttl=5.0, policy_args={"release_pin_on_admission": False})
    ex = ScriptedModelRunner()
    t1 = add(s, "t1", toks(100, 11))
    run_until_done(s, ex, t1)
    t1_blocks = s.kv_cache_manager.get_block_ids("t1")
    t2 = add(s, "t2", t1.all_token_ids + toks(900, 5))
    step(s, ex)
    assert set(s.pinned_jobs) == {"J"}  # kept during t2 in this mode
    run_until_done(s, ex, t2)
    assert s.pin_stats["replaced"] == 1 and len(s.pinned_jobs) == 1
    assert s.kv_cache_manager.get_block_ids("t1") == []
    t2_blocks = s.kv_cache_manager.get_block_ids("t2")
    assert t2_blocks[:3] == t1_blocks  # the shared prefix survived the older pin's release
    assert all(b.ref_cnt == 1 for b in s.kv_cache_manager.get_blocks("t2").blocks)
    assert free_usable(s) == 63 - len(t2_blocks)


def test_last_step_releases_the_jobs_pins_and_is_not_pinned():
    s, _clock, _ = build(ttl=5.0, policy_args={"release_pin_on_admission": False})
    ex = ScriptedModelRunner()
    t1 = add(s, "t1", toks(100, 10))
    run_until_done(s, ex, t1)
    t2 = add(s, "t2", t1.all_token_ids + toks(900, 5), is_last_step=True)
    run_until_done(s, ex, t2)
    assert s.pinned_jobs == {} and s.pin_stats["last_step"] == 1
    assert free_usable(s) == 63
    assert "J" not in s._jobs  # job state forgotten


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_aborted_or_errored_turn_is_never_pinned(status):
    s, _clock, est = build(ttl=5.0)
    ex = ScriptedModelRunner()
    add(s, "t1", toks(100, 10), max_tokens=20)
    step(s, ex)
    s.finish_requests("t1", status)
    assert s.pinned_jobs == {} and free_usable(s) == 63
    assert est.finished == []  # not even shown to the estimator


def test_no_pin_without_job_id_with_zero_ttl_or_without_prefix_caching():
    s, _, _ = build(ttl=5.0)
    run_until_done(s, ScriptedModelRunner(), add(s, "a", toks(100, 10), job=None))
    assert s.pinned_jobs == {} and free_usable(s) == 63
    s, _, _ = build(ttl=0.0)
    run_until_done(s, ScriptedModelRunner(), add(s, "a", toks(100, 10)))
    assert s.pinned_jobs == {} and free_usable(s) == 63
    s, _, _ = build(ttl=5.0, enable_prefix_caching=False)
    run_until_done(s, ScriptedModelRunner(), add(s, "a", toks(100, 10)))
    assert s.pinned_jobs == {} and free_usable(s) == 63


# ---------------------------------------------------------------------- queue order
def _req(rid: str, job: str | None, arrival: float, job_arrival: float | None = None) -> Request:
    from vllite.policies.continuum_turns import turn_info
    from vllite.sampling_params import SamplingParams

    r = Request(rid, [1, 2, 3], SamplingParams(extra_args={"job_id": job}), arrival_time=arrival)
    turn_info(r).job_arrival = arrival if job_arrival is None else job_arrival
    return r


def test_queue_order_preempted_then_pinned_then_program_fcfs():
    q = ContinuumRequestQueue()
    a2 = _req("a2", "A", arrival=9.0, job_arrival=0.0)  # later turn of the oldest job
    b1 = _req("b1", "B", arrival=1.0)
    c1 = _req("c1", "C", arrival=2.0)
    n1 = _req("n1", None, arrival=0.5)
    for r in (b1, c1, a2, n1):
        q.add_request(r)
    assert [r.request_id for r in q] == ["a2", "n1", "b1", "c1"]
    q.set_job_pinned("C", True)
    assert [r.request_id for r in q] == ["c1", "a2", "n1", "b1"]
    p = _req("p", "B", arrival=3.0, job_arrival=1.0)
    q.prepend_request(p)
    assert q.peek_request() is p
    assert [r.request_id for r in q] == ["p", "c1", "a2", "n1", "b1"]
    q.set_job_pinned("B", True)  # the preempted request stays in its tier; b1 moves up
    assert [r.request_id for r in q] == ["p", "b1", "c1", "a2", "n1"]
    q.set_job_pinned("C", False)
    assert [r.request_id for r in q] == ["p", "b1", "a2", "n1", "c1"]
    assert q.has_job("B") and len(q) == 5
    q.remove_request(b1)
    assert [q.pop_request().request_id for _ in range(len(q))] == ["p", "a2", "n1", "c1"]
    assert not q.has_job("B") and not q
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(ValueError):
        q.remove_request(b1)


def test_scheduler_admits_the_pinned_job_and_the_oldest_program_first():
    # Room for one request at a time: the order of admission is the queue order.
    s, _clock, _ = build(num_blocks=1 + 64, ttl=50.0, max_num_seqs=1)
    ex = ScriptedModelRunner()
    a1 = add(s, "a1", toks(100, 6), job="A", arrival=0.0)
    run_until_done(s, ex, a1)  # A pinned
    add(s, "b1", toks(200, 6), job="B", arrival=1.0)
    add(s, "c1", toks(300, 6), job="C", arrival=2.0)
    add(s, "a2", [*a1.all_token_ids, 5], job="A", arrival=3.0)  # pinned job: first
    order = []
    for _ in range(20):
        so = s.schedule()
        order += [n.req_id for n in so.scheduled_new_reqs]
        s.update_from_output(so, ex.execute(so))
    assert order == ["a2", "b1", "c1"]


# ---------------------------------------------------------------------- preemption
def test_victim_prefers_latest_job_and_refunds_an_already_scheduled_victim():
    # X (job arrival 10) is admitted before Y (job arrival 0), so X is scheduled first in the step where Y needs
    # a block: the victim is X, already scheduled — its tokens and blocks must be refunded (the fork's bug).
    s, _clock, _ = build(num_blocks=1 + 4, ttl=0.0)
    ex = ScriptedModelRunner()
    x = add(s, "x", toks(100, 5), job="X", arrival=10.0, max_tokens=11)
    step(s, ex)
    y = add(s, "y", toks(200, 7), job="Y", arrival=0.0, max_tokens=9)
    step(s, ex)
    assert [r.request_id for r in s.running] == ["x", "y"] and free_usable(s) == 0
    step(s, ex)  # both decode within their second block
    # Now x (first in running) still has a free slot and is scheduled; then y needs a third block.
    assert x.num_computed_tokens == 7 and y.num_computed_tokens == 8
    so = s.schedule()
    assert so.preempted_req_ids == {"x"}
    assert set(so.num_scheduled_tokens) == {"y"}  # x's token refunded
    assert so.total_num_scheduled_tokens == 1
    assert so.scheduled_cached_reqs.req_ids == ["y"]
    assert x.status == RequestStatus.PREEMPTED and x.num_computed_tokens == 0
    assert s.kv_cache_manager.get_block_ids("x") == []
    assert s.waiting.peek_request() is x
    s.update_from_output(so, ex.execute(so))
    run_until_done(s, ex, x, y, limit=200)


def test_victim_prefers_requests_of_unpinned_jobs():
    s, _, _ = build(policy_args={"release_pin_on_admission": False})
    running = [_req("p", "P", 5.0), _req("u", "U", 0.0), _req("q", "P", 6.0)]
    s._pins["P"] = object()  # type: ignore[assignment]  # only membership matters here
    assert s.select_preemption_victim(running, running[0]).request_id == "u"
    s._pins.clear()
    assert s.select_preemption_victim(running, running[0]).request_id == "q"


def _pin_jobs(s, ex, jobs: str) -> None:
    """Runs one 10-token turn per job (3 blocks each, job arrival = its index) and leaves it pinned."""
    for i, job in enumerate(jobs):
        r = add(s, f"{job}1", toks(100 * (i + 1), 10), job=job, arrival=float(i))
        run_until_done(s, ex, r)
    assert set(s.pinned_jobs) == set(jobs)


def test_running_request_that_needs_a_block_releases_the_latest_jobs_pin_instead_of_preempting():
    s, _clock, _ = build(num_blocks=1 + 9 + 1, ttl=100.0)
    ex = ScriptedModelRunner()
    _pin_jobs(s, ex, "AB")  # 6 blocks pinned, 4 free
    x = add(s, "x", toks(500, 7), job="X", arrival=5.0, max_tokens=20)  # 2 blocks
    y = add(s, "y", toks(700, 7), job="Y", arrival=6.0, max_tokens=20)  # 2 blocks
    step(s, ex)
    assert free_usable(s) == 0 and [r.request_id for r in s.running] == ["x", "y"]
    step(s, ex)  # 8 computed each: both blocks full
    so = s.schedule()  # x needs a third block: B's pin (latest job) goes, A's stays, nobody is preempted
    assert so.preempted_req_ids == set() and s.num_preemptions_total == 0
    assert so.num_scheduled_tokens == {"x": 1, "y": 1} and so.total_num_scheduled_tokens == 2
    assert set(s.pinned_jobs) == {"A"} and s.pin_stats["running_blocked"] == 1
    assert s.kv_cache_manager.get_block_ids("B1") == []
    assert free_usable(s) == 3 - 2  # B's 3 blocks: one each for x and y
    s.update_from_output(so, ex.execute(so))
    for _ in range(100):  # later growth releases A's pin before anything is preempted
        if x.is_finished() and y.is_finished():
            break
        so = step(s, ex)
        assert not so.preempted_req_ids or s.pinned_jobs == {}
    assert x.is_finished() and y.is_finished() and s.pin_stats["running_blocked"] == 2


def test_running_request_releases_its_own_jobs_pin_last_then_preempts():
    # release_pin_on_admission=False keeps X's pin while x (of job X, the latest job) runs: A's pin is released
    # first although X arrived later; then X's own pin; with no pin left, the base algorithm preempts.
    s, _clock, _ = build(num_blocks=1 + 8, ttl=100.0, policy_args={"release_pin_on_admission": False})
    ex = ScriptedModelRunner()
    _pin_jobs(s, ex, "AX")  # X's job arrival is 1.0, A's 0.0; 6 blocks pinned, 2 free
    x = add(s, "x", toks(500, 7), job="X", arrival=5.0, max_tokens=30)  # 2 blocks, no shared prefix
    step(s, ex)
    step(s, ex)
    assert free_usable(s) == 0 and x.num_computed_tokens == 8
    so = step(s, ex)  # x needs its 3rd block: A's pin goes, although X is the latest job
    assert so.preempted_req_ids == set() and set(s.pinned_jobs) == {"X"}
    while s.pinned_jobs:  # x fills A's 3 blocks (20 tokens in 5 blocks), then needs a 6th: X's own pin goes
        so = step(s, ex)
        assert so.preempted_req_ids == set() and x.num_computed_tokens <= 21
    assert x.num_computed_tokens == 21 and s.pin_stats["running_blocked"] == 2
    assert free_usable(s) == 2  # X's 3 blocks, one taken by x
    for _ in range(20):  # no pin left: x outgrows all 8 blocks (32 tokens)
        if x.num_computed_tokens == 32:
            break
        so = step(s, ex)
        assert so.preempted_req_ids == set()
    # Alone and out of blocks, x can never fit: it ends with ERROR (its blocks freed) instead of preempting itself
    # and recomputing forever.
    so = step(s, ex)
    assert so.preempted_req_ids == set() and x.num_preemptions == 0 and "x" in so.finished_req_ids
    assert x.status == RequestStatus.FINISHED_ERROR and "cannot hold request 'x'" in (x.error or "")
    assert free_usable(s) == 8 and not s.running
    assert s.pin_stats["running_blocked"] == 2


def test_running_allocation_failure_preempts_and_keeps_pins_when_configured_off():
    s, _clock, _ = build(num_blocks=1 + 9 + 1, ttl=100.0, policy_args={"release_pins_before_preemption": False})
    ex = ScriptedModelRunner()
    _pin_jobs(s, ex, "AB")
    add(s, "x", toks(500, 7), job="X", arrival=5.0, max_tokens=20)
    add(s, "y", toks(700, 7), job="Y", arrival=6.0, max_tokens=20)
    step(s, ex)
    step(s, ex)
    so = s.schedule()
    assert so.preempted_req_ids == {"y"} and so.num_scheduled_tokens == {"x": 1}
    assert set(s.pinned_jobs) == {"A", "B"} and s.pin_stats["running_blocked"] == 0


# ---------------------------------------------------------------------- deadlock release
def test_head_that_cannot_fit_releases_pins_latest_job_first_until_it_fits():
    s, _clock, _ = build(num_blocks=1 + 9, ttl=100.0)
    ex = ScriptedModelRunner()
    for i, job in enumerate("ABC"):
        r = add(s, f"{job}1", toks(100 * (i + 1), 10), job=job, arrival=float(i))  # 3 blocks each
        run_until_done(s, ex, r)
    assert set(s.pinned_jobs) == {"A", "B", "C"} and free_usable(s) == 0
    n = add(s, "n", toks(900, 19), job="N", arrival=5.0, max_tokens=1)  # needs 5 blocks
    so = s.schedule()
    assert [r.req_id for r in so.scheduled_new_reqs] == ["n"]
    assert set(s.pinned_jobs) == {"A"}  # C then B released; A (earliest job) kept
    assert s.pin_stats["deadlock"] == 2
    s.update_from_output(so, ex.execute(so))
    assert n.is_finished()


def test_head_that_cannot_fit_without_pins_waits_without_crashing():
    s, _, _ = build(num_blocks=1 + 4, ttl=0.0)
    ex = ScriptedModelRunner()
    big = add(s, "big", toks(100, 12), max_tokens=5)
    step(s, ex)
    small = add(s, "small", toks(500, 6), job="S", max_tokens=1)
    so = step(s, ex)
    assert "small" not in so.num_scheduled_tokens and small in s.waiting
    run_until_done(s, ex, big, small, limit=100)


@pytest.mark.parametrize("release_first", [True, False])
def test_lone_running_request_that_cannot_grow_with_pins_recovers(release_first):
    # Regression (fork: IndexError / pin-only release when running <= 1): a lone running request needs a block,
    # all others are pinned. Default: the pin is released and the request keeps running. Without
    # release_pins_before_preemption it preempts itself; the next step releases pins and re-admits it.
    s, _clock, _ = build(num_blocks=1 + 6, ttl=100.0, policy_args={"release_pins_before_preemption": release_first})
    ex = ScriptedModelRunner()
    a = add(s, "a1", toks(100, 10), job="A")
    run_until_done(s, ex, a)  # 3 blocks pinned
    lone = add(s, "lone", toks(500, 11), job="L", arrival=1.0, max_tokens=10)  # 3 blocks, needs a 4th at 12+1
    run_until_done(s, ex, lone, limit=40)
    assert lone.status == RequestStatus.FINISHED_LENGTH_CAPPED
    if release_first:
        assert lone.num_preemptions == 0 and s.num_preemptions_total == 0
        assert s.pin_stats["running_blocked"] == 1 and s.pin_stats["deadlock"] == 0
    else:
        assert lone.num_preemptions == 1 and s.pin_stats["running_blocked"] == 0
        assert s.pin_stats["deadlock"] >= 1


def test_lone_running_request_without_pins_does_not_crash():
    s, _, _ = build(num_blocks=1 + 3, ttl=0.0)
    ex = ScriptedModelRunner()
    lone = add(s, "lone", toks(100, 11), max_tokens=5)  # grows past 3 blocks: cannot ever fit
    for _ in range(6):
        step(s, ex)
    # It ends with ERROR, its blocks freed, instead of preempting itself and recomputing forever.
    assert lone.status == RequestStatus.FINISHED_ERROR and "cannot hold request 'lone'" in (lone.error or "")
    assert lone.num_preemptions == 0 and free_usable(s) == 3 and not s.has_unfinished_requests()


# ---------------------------------------------------------------------- the fork's other bugs
def test_several_pins_expiring_in_one_step_are_all_released():
    # Fork: removed items from the list it iterated over, skipping every other expired pin.
    s, clock, _ = build(ttl=1.0)
    ex = ScriptedModelRunner()
    reqs = [add(s, f"{j}1", toks(100 * (i + 1), 6), job=j) for i, j in enumerate("ABCD")]
    run_until_done(s, ex, *reqs)
    assert len(s.pinned_jobs) == 4
    clock.now = 1.0
    s.schedule()
    assert s.pinned_jobs == {} and free_usable(s) == 63


def test_first_turn_with_last_func_call_and_overlapping_turns_do_not_crash():
    # Fork: asserted last_func_call is None on a job's first turn, and crashed (KeyError) on overlapping turns.
    s, _clock, _est = build(ttl=1.0)
    ex = ScriptedModelRunner()
    a = add(s, "a", toks(100, 6), last_func_call="ls")
    b = add(s, "b", toks(200, 6))  # same job, in flight at the same time
    run_until_done(s, ex, a, b)
    assert len(s.pinned_jobs) == 1  # one pin per job


def test_client_tool_name_wins_over_parsing_and_parser_used_otherwise():
    calls = []

    class Parser:
        def parse(self, text):
            calls.append(text)
            return "parsed"

    config = make_config(block_size=BS)
    est = ConstTTL()
    s = ContinuumScheduler(
        config,
        64,
        clock=Clock(),
        step_observer=None,
        estimator=est,
        tool_parser=Parser(),
        detokenize=lambda ids: " ".join(map(str, ids)),
    )
    ex = ScriptedModelRunner()
    a = add(s, "a", toks(100, 6), job="A", this_func_call="grep")
    b = add(s, "b", toks(200, 6), job="B")
    run_until_done(s, ex, a, b)
    assert sorted((rid, tool) for rid, _, tool in est.finished) == [("a", "grep"), ("b", "parsed")]
    assert calls == [" ".join(map(str, b.output_token_ids))]


def test_reset_prefix_cache_succeeds_with_pins():
    s, _, _ = build(ttl=5.0)
    run_until_done(s, ScriptedModelRunner(), add(s, "a", toks(100, 10)))
    assert s.pinned_jobs
    assert s.reset_prefix_cache() is True
    assert s.pinned_jobs == {} and free_usable(s) == 63


def test_reused_request_id_of_a_pinned_request_releases_the_pin():
    s, _, _ = build(ttl=5.0)
    ex = ScriptedModelRunner()
    run_until_done(s, ex, add(s, "a", toks(100, 10)))
    again = add(s, "a", toks(300, 6), job="K")
    assert s.pinned_jobs == {} and s.pin_stats["id_reused"] == 1
    run_until_done(s, ex, again)


# ---------------------------------------------------------------------- estimator feed and bounded state
def test_estimator_sees_arrivals_finishes_and_evicted_waits():
    s, clock, est = build(ttl=0.0)  # nothing pinned: every later turn is "evicted"
    ex = ScriptedModelRunner()
    t1 = add(s, "t1", toks(100, 6))
    run_until_done(s, ex, t1)
    clock.now = 3.0
    t2 = add(s, "t2", [*t1.all_token_ids, 7])
    clock.now = 3.5
    run_until_done(s, ex, t2)
    assert est.arrived == [("t1", 0.0), ("t2", 3.0)]
    assert [rid for rid, _, _ in est.finished] == ["t1", "t2"]
    assert est.waits == [0.5]  # the first turn is not an evicted one


def test_job_state_is_bounded():
    s, clock, _ = build(ttl=0.0, policy_args={"job_idle_timeout_s": 10.0, "max_jobs": 5})
    ex = ScriptedModelRunner()
    for i in range(40):
        r = add(s, f"r{i}", toks(100 + i, 5), job=f"job{i}", arrival=float(i))
        run_until_done(s, ex, r)
    assert len(s._jobs) <= 5 + 8  # soft cap: a few are trimmed per arrival
    clock.now = 100.0
    for _ in range(10):
        s.schedule()
    assert len(s._jobs) == 0


def test_registered_and_selected_by_name(monkeypatch):
    monkeypatch.setattr(
        plugin_manager,
        "BUILTIN_PLUGINS",
        ("vllite.policies.builtin", "vllite.policies.continuum_plugin", "vllite.plugins.tool_parsers.plugin"),
    )
    monkeypatch.setattr(plugin_manager, "_manager", plugin_manager.PluginManager(load_entry_points=False))
    config = make_config(scheduler_cls="continuum")
    s = create_scheduler(config, 32)
    assert isinstance(s, ContinuumScheduler) and isinstance(s.estimator, UtilityEstimator)
    config = make_config(scheduler_cls="continuum", tool_call_estimator="fixed")
    assert isinstance(create_scheduler(config, 32).estimator, FixedTTLEstimator)
    assert set(plugin_manager.get_registry("tool_parsers")) >= {"auto", "bash", "openai", "hermes", "llama"}
