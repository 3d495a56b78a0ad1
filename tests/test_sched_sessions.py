"""The scheduler's side of sessions (``vllite.sched.sessions``), step by step with a scripted model runner and a
manual clock: a turn end parks the session holding its blocks, the hold expires or gives way under memory pressure,
the next chunk resumes it, and Continuum times the hold with its estimator."""

from __future__ import annotations

import pytest

from tests.test_continuum import Clock, ConstTTL
from vllite.exceptions import SessionClosedError
from vllite.policies.continuum import ContinuumScheduler
from vllite.request import Request, RequestStatus
from vllite.sampling_params import SamplingParams
from vllite.sched import Scheduler
from vllite.testing import ScriptedModelRunner, make_config

BS = 4


def build(num_blocks: int = 64, policy_args=None, cls=Scheduler, **kw):
    config = make_config(block_size=BS, policy_args=policy_args)
    clock = Clock()
    scheduler = cls(config, num_blocks, clock=clock, step_observer=None, **kw)
    return scheduler, clock, ScriptedModelRunner()


def session(
    s, rid: str, tokens: list[int], *, max_tokens: int = 2, chunk: bool = False, resumable: bool = True, **extra
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)
    return Request(rid, tokens, params, block_hasher=s.block_hasher, resumable=resumable, continuation=chunk)


def step(s, ex):
    so = s.schedule()
    return so, s.update_from_output(so, ex.execute(so))


def run_turn(s, ex, request_id: str, limit: int = 20):
    """Steps until the request's turn ends; returns that output."""
    for _ in range(limit):
        _, outputs = step(s, ex)
        for output in outputs.get(0, None).outputs if 0 in outputs else []:
            if output.request_id == request_id and output.finish_reason is not None:
                return output
    raise AssertionError("the turn did not end")


def test_a_turn_end_parks_the_session_with_its_blocks_and_the_next_chunk_prefills_only_new_tokens():
    s, _, ex = build()
    s.add_request(session(s, "a", list(range(10, 20))))
    output = run_turn(s, ex, "a")
    assert output.session_open and not output.finished and len(s.requests["a"].output_token_ids) == 2
    request = s.requests["a"]
    assert request.status == RequestStatus.WAITING_FOR_STREAMING_REQ and "a" in s.session_holds
    assert request.num_computed_tokens == 11  # 10 prompt tokens and the first output; the last has no KV yet
    blocks = s.kv_cache_manager.get_block_ids("a")
    so, outputs = step(s, ex)  # an idle step: the workers drop it, the client is not told
    assert "a" in so.finished_req_ids and not any(o.finished_requests for o in outputs.values())
    s.add_session_chunk(session(s, "a", [7, 8, 9], chunk=True))
    so = s.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 11 and new.prompt_token_ids == request.all_token_ids
    assert so.num_scheduled_tokens == {"a": 15 - 11}
    assert new.block_ids[: len(blocks)] == blocks


def test_the_hold_expires_on_the_clock_and_the_next_turn_recomputes_through_the_prefix_cache():
    s, clock, ex = build(policy_args={"session_idle_timeout_s": 5})
    s.add_request(session(s, "a", list(range(10, 20))))
    run_turn(s, ex, "a")
    clock.now = 4.9
    step(s, ex)
    assert "a" in s.session_holds and s.kv_cache_manager.get_block_ids("a")
    clock.now = 5.0
    step(s, ex)
    assert "a" not in s.session_holds and s.requests["a"].num_computed_tokens == 0
    assert s.kv_cache_manager.usage == 0.0
    s.add_session_chunk(session(s, "a", [7, 8, 9], chunk=True))
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8  # two full blocks survived in the prefix cache


def test_a_held_session_gives_its_tail_blocks_to_a_running_request_before_anything_is_preempted():
    s, _, ex = build(num_blocks=9)  # 8 usable blocks of 4 tokens
    s.add_request(session(s, "parked", list(range(10, 20))))  # 12 tokens: 3 blocks
    run_turn(s, ex, "parked")
    head = s.kv_cache_manager.get_block_ids("parked")[0]
    s.add_request(session(s, "big", list(range(30, 50)), max_tokens=8, resumable=False))  # needs 7 blocks
    run_turn(s, ex, "big")
    assert s.num_preemptions_total == 0
    # Only the 2 missing blocks went, from the tail: the session keeps its first block and the 4 tokens in it.
    assert "parked" in s.session_holds and s.kv_cache_manager.get_block_ids("parked") == [head]
    assert s.requests["parked"].num_computed_tokens == 4
    assert s.session_holds.num_blocks_released_for_memory == 2
    step(s, ex)  # "big" leaves
    s.add_session_chunk(session(s, "parked", [7, 8, 9], chunk=True))
    so = s.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 4 and so.num_scheduled_tokens == {"parked": 15 - 4}
    assert new.block_ids[0] == head and "parked" not in s.session_holds


def test_a_hold_that_loses_every_block_is_released_and_its_next_turn_looks_up_the_prefix_cache():
    s, _, ex = build(num_blocks=9)  # 8 usable blocks of 4 tokens
    s.add_request(session(s, "parked", list(range(10, 20))))  # 12 tokens: 3 blocks
    run_turn(s, ex, "parked")
    s.add_request(session(s, "big", list(range(30, 50)), max_tokens=12, resumable=False))  # needs 8 blocks
    run_turn(s, ex, "big")
    assert s.num_preemptions_total == 0
    assert "parked" not in s.session_holds and s.requests["parked"].num_computed_tokens == 0
    assert s.session_holds.num_blocks_released_for_memory == 3
    step(s, ex)
    s.add_session_chunk(session(s, "parked", [7, 8, 9], chunk=True))
    queries = s.kv_cache_manager.prefix_cache_stats.queries
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # "big" reused every block
    assert s.kv_cache_manager.prefix_cache_stats.queries == queries + 15  # but the turn did look


def test_with_nothing_running_the_waiting_head_takes_only_the_blocks_it_lacks_from_a_hold():
    s, _, ex = build(num_blocks=9)  # 8 usable blocks of 4 tokens
    s.add_request(session(s, "a", list(range(10, 22)), max_tokens=5))  # 16 tokens: 4 blocks, held
    run_turn(s, ex, "a")
    s.add_request(session(s, "new", list(range(30, 47)), resumable=False))  # 17 tokens: 5 blocks, 4 free
    so, _ = step(s, ex)
    assert set(so.num_scheduled_tokens) == {"new"}
    assert len(s.kv_cache_manager.get_block_ids("a")) == 3 and s.requests["a"].num_computed_tokens == 12
    assert s.session_holds.num_blocks_released_for_memory == 1


def test_a_queued_session_at_the_head_never_trims_its_own_hold():
    s, _, ex = build(num_blocks=9)  # 8 usable blocks of 4 tokens
    s.add_request(session(s, "a", list(range(10, 30)), max_tokens=4))  # 24 tokens: 6 blocks, held
    run_turn(s, ex, "a")
    blocks = s.kv_cache_manager.get_block_ids("a")
    s.add_session_chunk(session(s, "a", list(range(40, 52)), chunk=True))  # 36 tokens: 9 blocks, never fit
    so, _ = step(s, ex)
    assert not so.num_scheduled_tokens and s.session_holds.num_blocks_released_for_memory == 0
    assert s.requests.get("a") is None or s.requests["a"].is_finished()  # failed: it can never fit
    assert blocks and s.kv_cache_manager.usage == 0.0


def test_chunks_queue_behind_a_running_turn_and_the_end_of_input_finishes_it():
    s, _, ex = build()
    s.add_request(session(s, "a", list(range(10, 20))))
    s.add_session_chunk(session(s, "a", [7, 8], chunk=True))
    s.add_session_chunk(session(s, "a", [], chunk=True, resumable=False))  # the end of the input
    with pytest.raises(SessionClosedError, match="input already ended"):
        s.add_session_chunk(session(s, "a", [1], chunk=True))
    first = run_turn(s, ex, "a")
    assert first.session_open  # the queued chunk starts the next turn at once
    assert s.requests["a"].status == RequestStatus.WAITING
    last = run_turn(s, ex, "a")
    assert last.finished and "a" not in s.requests and s.kv_cache_manager.usage == 0.0


def test_the_end_of_input_of_a_parked_session_sends_its_finish_output():
    s, _, ex = build()
    s.add_request(session(s, "a", list(range(10, 20))))
    run_turn(s, ex, "a")
    s.add_session_chunk(session(s, "a", [], chunk=True, resumable=False))
    _, outputs = step(s, ex)
    (output,) = outputs[0].outputs
    assert output.finished and str(output.finish_reason) == "length" and output.new_token_ids == []
    assert s.kv_cache_manager.usage == 0.0
    with pytest.raises(SessionClosedError, match="not open"):
        s.add_session_chunk(session(s, "a", [1], chunk=True))


def test_continuum_holds_a_session_for_the_estimators_ttl_of_its_tool():
    estimator = ConstTTL(ttl=3.0)
    s, clock, ex = build(cls=ContinuumScheduler, estimator=estimator, tool_parser=None)
    s.add_request(session(s, "t", list(range(10, 20)), this_func_call="ls"))
    run_turn(s, ex, "t")
    assert s.session_holds._held["t"][0] == 3.0 and estimator.finished == [("t", 0.0, "ls")]
    clock.now = 1.5
    s.add_session_chunk(session(s, "t", [7], chunk=True))
    assert estimator.arrived[-1] == ("t", 1.5)
    # A turn whose tool is unknown is held for the base idle timeout.
    s.add_request(session(s, "u", list(range(40, 50))))
    run_turn(s, ex, "u")
    assert s.session_holds._held["u"][0] == clock.now + 60.0


def test_continuum_holds_a_long_tools_session_for_the_idle_timeout_instead_of_releasing_it():
    estimator = ConstTTL(ttl=0.0)  # the estimator would not pin: the tool is expected to take long
    s, _, ex = build(cls=ContinuumScheduler, estimator=estimator, tool_parser=None)
    s.add_request(session(s, "t", list(range(10, 20)), this_func_call="train"))
    run_turn(s, ex, "t")
    assert s.session_holds._held["t"][0] == 60.0 and s.requests["t"].num_computed_tokens == 11


def test_a_blocked_new_request_lets_a_queued_session_holding_its_blocks_go_first():
    s, _, ex = build(num_blocks=9)  # 8 usable blocks of 4 tokens
    s.add_request(session(s, "a", list(range(10, 20))))  # 12 tokens with its outputs: 3 blocks, held
    run_turn(s, ex, "a")
    s.add_request(session(s, "new", list(range(30, 43)), resumable=False, max_tokens=3))  # 4 blocks, 16 slots
    s.add_request(session(s, "filler", list(range(60, 68)), resumable=False))  # 2 blocks: only 1 is free
    so, _ = step(s, ex)
    assert set(so.num_scheduled_tokens) == {"new"}  # the hold is kept while "new" runs
    s.add_session_chunk(session(s, "a", [1, 2], chunk=True))  # 14 tokens: one more block; queued behind "filler"
    so, _ = step(s, ex)
    assert set(so.num_scheduled_tokens) == {"new", "a"}  # "filler" was set aside for the session behind it
    assert [r.request_id for r in s.waiting] == ["filler"]
    assert s.session_holds.num_blocks_released_for_memory == 0


def test_session_holds_name_the_soonest_other_hold_and_forget_admitted_turns():
    s, _, _ = build()
    holds = s.session_holds
    a, b = session(s, "a", [1]), session(s, "b", [2])
    holds.hold(a, 5.0)
    holds.hold(b, 2.0)
    assert holds.soonest() is b and holds.soonest(other_than="b") is a and "b" in holds
    for _ in range(100):  # each turn queued then admitted leaves a heap entry that never expires
        holds.hold(b, float("inf"))
        holds.discard("b")
    assert len(holds._heap) <= 2 * len(holds) + 16 and holds.pop_soonest() is a and not holds
