"""The token-budget scheduler with a scripted model runner: budgets, chunked prefill, prefix caching, stops, aborts,
pause states, speculative decoding, the executor-facing output and stats."""

from __future__ import annotations

import pytest

from vllite.protocol import EngineCoreEventType, FinishReason
from vllite.request import RequestStatus
from vllite.sched import PauseState, Scheduler
from vllite.sched.output import ModelRunnerOutput
from vllite.testing import ScriptedModelRunner, make_config, make_model_runner_output, make_request


def build(num_blocks: int = 200, log_stats: bool = False, **config_kw) -> Scheduler:
    return Scheduler(make_config(**config_kw), num_blocks, log_stats=log_stats, step_observer=None)


def add(s: Scheduler, rid: str, prompt: list[int], **kw):
    kw.setdefault("max_tokens", 100)
    request = make_request(s, rid, prompt, **kw)
    s.add_request(request)
    return request


def run_steps(s: Scheduler, ex: ScriptedModelRunner, n: int) -> list[dict[str, int]]:
    trace = []
    for _ in range(n):
        so = s.schedule()
        trace.append(dict(so.num_scheduled_tokens))
        s.update_from_output(so, ex.execute(so))
    return trace


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------------- running allocation hook
class KeepFinishedBlocks(Scheduler):
    """Test policy: keeps the blocks of finished requests and releases one of them (oldest first) whenever a
    running request cannot get blocks, before any preemption."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list = []
        self.calls: list[str] = []

    def on_request_finished(self, request) -> bool:
        self.kept.append(request)
        return False

    def on_running_allocation_failed(self, request) -> bool:
        self.calls.append(request.request_id)
        if not self.kept:
            return False
        self.kv_cache_manager.free(self.kept.pop(0))
        return True


def test_default_running_allocation_hook_is_false_and_preemption_follows():
    s = build(num_blocks=1 + 2, block_size=4)
    a = add(s, "A", prompt(0, 4), max_tokens=10)
    assert s.on_running_allocation_failed(a) is False
    b = add(s, "B", prompt(100, 4), max_tokens=10)
    ex = ScriptedModelRunner()
    run_steps(s, ex, 1)  # 1 block each: the cache is full
    so = s.schedule()  # A needs a second block: FCFS preempts B (the last admitted)
    assert so.preempted_req_ids == {"B"} and so.num_scheduled_tokens == {"A": 1}
    assert b.status == RequestStatus.PREEMPTED


def test_running_allocation_hook_frees_blocks_and_the_allocation_is_retried_without_preemption():
    s = KeepFinishedBlocks(make_config(block_size=4), 1 + 3, step_observer=None)
    ex = ScriptedModelRunner()
    done = add(s, "done", prompt(0, 3), max_tokens=1)
    run_steps(s, ex, 1)
    assert done.is_finished() and s.kv_cache_manager.num_free_blocks == 2  # its block is kept by the policy
    a = add(s, "A", prompt(100, 4), max_tokens=10)
    b = add(s, "B", prompt(200, 3), max_tokens=10)  # needs its second block one step after A
    run_steps(s, ex, 1)
    assert s.kv_cache_manager.num_free_blocks == 0
    so = s.schedule()  # A needs a block: the hook frees the kept one; nobody is preempted
    assert s.calls == ["A"] and so.preempted_req_ids == set()
    assert so.num_scheduled_tokens == {"A": 1, "B": 1} and s.num_preemptions_total == 0
    s.update_from_output(so, ex.execute(so))
    so = s.schedule()  # B needs a block, nothing kept: the hook says False, the base algorithm preempts B
    assert s.calls == ["A", "B"] and so.preempted_req_ids == {"B"} and so.num_scheduled_tokens == {"A": 1}
    assert b.status == RequestStatus.PREEMPTED and a.status == RequestStatus.RUNNING


# ---------------------------------------------------------------------- budgets and chunking
def test_token_budget_trace_with_chunked_prefill():
    s = build(max_num_batched_tokens=16)
    add(s, "A", prompt(100, 10))
    add(s, "B", prompt(200, 20))
    add(s, "C", prompt(300, 5))
    trace = run_steps(s, ScriptedModelRunner(), 5)
    assert trace == [
        {"A": 10, "B": 6},  # B's prompt is chunked; C waits for budget
        {"A": 1, "B": 14, "C": 1},  # running first (A decodes, B finishes its prompt), then C's first chunk
        {"A": 1, "B": 1, "C": 4},
        {"A": 1, "B": 1, "C": 1},
        {"A": 1, "B": 1, "C": 1},
    ]


def test_chunked_prefill_off_admits_whole_prompts_or_stops():
    s = build(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    add(s, "A", prompt(100, 10))
    add(s, "B", prompt(200, 12))
    add(s, "C", prompt(300, 4))  # would fit in step 1, but B blocks the queue
    trace = run_steps(s, ScriptedModelRunner(), 3)
    assert trace == [{"A": 10}, {"A": 1, "B": 12}, {"A": 1, "B": 1, "C": 4}]


def test_long_prefill_threshold_caps_each_request():
    s = build(max_num_batched_tokens=32, long_prefill_token_threshold=4)
    for rid in "ABC":
        add(s, rid, prompt(ord(rid) * 100, 10))
    assert run_steps(s, ScriptedModelRunner(), 4) == [
        {"A": 4, "B": 4, "C": 4},
        {"A": 4, "B": 4, "C": 4},
        {"A": 2, "B": 2, "C": 2},
        {"A": 1, "B": 1, "C": 1},
    ]


def test_max_num_seqs_caps_admission():
    s = build(max_num_batched_tokens=64, max_num_seqs=2)
    for rid in "ABC":
        add(s, rid, prompt(ord(rid) * 100, 3), max_tokens=2)
    assert run_steps(s, ScriptedModelRunner(), 3) == [{"A": 3, "B": 3}, {"A": 1, "B": 1}, {"C": 3}]


def test_budget_shared_by_decodes_and_prefill_and_running_keeps_order():
    s = build(max_num_batched_tokens=8)
    ex = ScriptedModelRunner()
    add(s, "A", prompt(100, 3))
    add(s, "B", prompt(200, 3))
    run_steps(s, ex, 1)
    add(s, "C", prompt(300, 30))
    assert run_steps(s, ex, 2) == [{"A": 1, "B": 1, "C": 6}, {"A": 1, "B": 1, "C": 6}]
    assert [r.request_id for r in s.running] == ["A", "B", "C"]


# ---------------------------------------------------------------------- prefix caching
def test_prefix_cache_hits_are_block_aligned_and_leave_one_token():
    s = build(block_size=4)
    ex = ScriptedModelRunner()
    base = prompt(500, 13)
    add(s, "A", base)
    run_steps(s, ex, 1)
    b = add(s, "B", [*base[:12], 7, 8])  # 3 shared full blocks
    c = add(s, "C", list(base))  # identical: the hit leaves the last token to compute
    d = add(s, "D", base[:12])  # 12 tokens: the hit is capped at 11 -> 2 blocks
    so = s.schedule()
    assert so.num_scheduled_tokens == {"A": 1, "B": 2, "C": 1, "D": 4}
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert new["B"].num_computed_tokens == 12 and new["C"].num_computed_tokens == 12
    assert new["D"].num_computed_tokens == 8
    assert new["B"].block_ids[:3] == s.kv_cache_manager.get_block_ids("A")[:3]
    outs = s.update_from_output(so, ex.execute(so))[0].outputs
    assert {o.request_id: o.num_cached_tokens for o in outs} == {"A": 0, "B": 12, "C": 12, "D": 8}
    assert (b.num_cached_tokens, c.num_cached_tokens, d.num_cached_tokens) == (12, 12, 8)


def test_prefix_cache_disabled_means_no_hits():
    s = build(enable_prefix_caching=False)
    assert s.block_hasher is None
    add(s, "A", prompt(500, 13))
    run_steps(s, ScriptedModelRunner(), 1)
    add(s, "B", prompt(500, 13))
    so = s.schedule()
    assert so.num_scheduled_tokens["B"] == 13


def test_prefix_hit_after_the_first_request_finished():
    s = build(block_size=4, log_stats=True)
    ex = ScriptedModelRunner()
    add(s, "A", prompt(500, 9), max_tokens=1)
    run_steps(s, ex, 1)
    assert not s.requests and s.kv_cache_manager.num_cached_blocks == 2
    add(s, "B", prompt(500, 9))
    assert s.schedule().num_scheduled_tokens == {"B": 1}
    stats = s.make_stats()
    assert stats is not None and (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9, 8)


def test_prefix_stats_count_a_blocked_request_once():
    """A waiting request refused blocks for several steps is one lookup, recorded when it is admitted."""
    s = build(num_blocks=1 + 3, block_size=4, log_stats=True)
    ex = ScriptedModelRunner()
    add(s, "A", prompt(500, 9), max_tokens=4)  # 3 blocks of 3: B cannot be admitted while A runs
    run_steps(s, ex, 1)
    b = add(s, "B", prompt(500, 9), max_tokens=1)
    for _ in range(3):
        so = s.schedule()
        assert "B" not in so.num_scheduled_tokens
        s.update_from_output(so, ex.execute(so))
    assert s.kv_cache_manager.prefix_cache_stats.requests == 1  # A only
    run_steps(s, ex, 2)  # A finishes, B is admitted with its 8-token hit
    assert b.is_finished() and b.num_cached_tokens == 8
    stats = s.kv_cache_manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)


# ---------------------------------------------------------------------- stop conditions
def one_request_run(s: Scheduler, tokens: list[int], **kw):
    r = add(s, "R", prompt(10, 4), **kw)
    ex = ScriptedModelRunner({"R": tokens})
    outs = []
    for _ in range(len(tokens) + 2):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        for eco in s.update_from_output(so, ex.execute(so)).values():
            outs.extend(eco.outputs)
    return r, outs


def test_stop_on_eos():
    r, outs = one_request_run(build(), [5, 6, 2, 9], eos_token_id=2)
    assert r.output_token_ids == [5, 6, 2]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].new_token_ids == [2]


def test_ignore_eos_keeps_going():
    r, _ = one_request_run(build(), [5, 2, 2, 9], eos_token_id=2, ignore_eos=True, max_tokens=4)
    assert r.output_token_ids == [5, 2, 2, 9] and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_id_sets_stop_reason():
    r, outs = one_request_run(build(), [5, 42, 9], stop_token_ids=[42])
    assert r.output_token_ids == [5, 42]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == 42


def test_min_tokens_suppresses_eos_and_stop_tokens():
    r, _ = one_request_run(build(), [2, 42, 2, 9], eos_token_id=2, stop_token_ids=[42], min_tokens=3)
    assert r.output_token_ids == [2, 42, 2] and r.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens():
    r, outs = one_request_run(build(), [5, 6, 7, 8], max_tokens=3)
    assert r.output_token_ids == [5, 6, 7]
    assert outs[-1].finish_reason == FinishReason.LENGTH


def test_max_model_len_caps_and_stops():
    s = build(max_model_len=8, max_num_batched_tokens=8)
    r = add(s, "R", prompt(10, 6), max_tokens=None)
    ex = ScriptedModelRunner()
    trace = run_steps(s, ex, 3)
    assert trace == [{"R": 6}, {"R": 1}, {}]
    assert r.num_tokens == 8 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_prompt_longer_than_max_model_len_and_duplicates_are_rejected():
    s = build(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        add(s, "R", prompt(0, 9))
    add(s, "S", prompt(0, 8))
    with pytest.raises(ValueError, match="already"):
        add(s, "S", prompt(0, 3))


# ---------------------------------------------------------------------- aborts
def test_abort_in_waiting_running_and_preempted_states_is_idempotent():
    s = build(num_blocks=5, block_size=4, max_num_batched_tokens=32)  # 4 usable blocks
    ex = ScriptedModelRunner()
    add(s, "A", prompt(100, 7))
    add(s, "B", prompt(200, 7))
    run_steps(s, ex, 2)  # both hold 2 blocks, 9 tokens each
    add(s, "W", prompt(300, 3))
    so = s.schedule()  # A needs a third block: B (last admitted) is preempted
    assert so.preempted_req_ids == {"B"} and s.requests["B"].status == RequestStatus.PREEMPTED
    s.update_from_output(so, ex.execute(so))
    free_before = s.kv_cache_manager.num_free_blocks

    done = s.finish_requests(["B", "W", "A", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["B", "W", "A"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    assert s.finish_requests("A", RequestStatus.FINISHED_ABORTED) == []
    assert not s.running and not s.waiting and not s.requests
    assert s.kv_cache_manager.num_free_blocks == 4 > free_before
    assert not s.has_unfinished_requests() and s.has_requests()  # finished ids still to report
    so = s.schedule()
    assert so.finished_req_ids == {"A", "B", "W"} and so.total_num_scheduled_tokens == 0
    out = s.update_from_output(so, ex.execute(so))
    assert out[0].finished_requests == {"A", "B", "W"} and out[0].outputs == []
    assert not s.has_requests()


def test_abort_all_and_abort_while_model_runs():
    s = build()
    ex = ScriptedModelRunner()
    add(s, "A", prompt(0, 5))
    add(s, "B", prompt(10, 5))
    so = s.schedule()
    s.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # arrives while the model runs
    outs = s.update_from_output(so, ex.execute(so))[0].outputs
    assert [o.request_id for o in outs] == ["B"]
    assert len(s.finish_requests(None, RequestStatus.FINISHED_ABORTED)) == 1
    assert s.kv_cache_manager.num_free_blocks == 199
    with pytest.raises(ValueError):
        s.finish_requests("B", RequestStatus.RUNNING)


# ---------------------------------------------------------------------- pause states
def test_pause_states():
    s = build()
    ex = ScriptedModelRunner()
    add(s, "A", prompt(0, 4))
    run_steps(s, ex, 1)
    add(s, "B", prompt(10, 4))
    s.set_pause_state(PauseState.PAUSED_NEW)
    assert s.pause_state == PauseState.PAUSED_NEW
    assert s.get_num_unfinished_requests() == 1 and s.get_request_counts() == (1, 1)
    assert run_steps(s, ex, 1) == [{"A": 1}]  # running continues, nothing admitted
    s.set_pause_state(PauseState.PAUSED_ALL)
    assert s.get_num_unfinished_requests() == 0 and not s.has_requests()
    so = s.schedule()
    assert so.num_scheduled_tokens == {} and so.total_num_scheduled_tokens == 0
    s.update_from_output(so, ex.execute(so))
    s.set_pause_state(PauseState.UNPAUSED)
    assert s.get_num_unfinished_requests() == 2
    assert run_steps(s, ex, 1) == [{"A": 1, "B": 4}]


# ---------------------------------------------------------------------- speculative decoding
def test_spec_decode_accept_and_reject_accounting():
    s = build(max_num_batched_tokens=64)
    r = add(s, "R", prompt(0, 5))
    ex = ScriptedModelRunner(accept=lambda rid, drafts: 1)  # first draft accepted, the rest rejected
    run_steps(s, ex, 1)
    assert (r.num_tokens, r.num_computed_tokens) == (6, 5)
    s.update_draft_token_ids({"R": [7, 8, 9], "gone": [1]})
    so = s.schedule()
    assert so.num_scheduled_tokens == {"R": 4} and so.scheduled_spec_decode_tokens == {"R": [7, 8, 9]}
    assert r.spec_token_ids == [] and r.num_computed_tokens == 9
    assert so.scheduled_cached_reqs.new_token_ids == [[1005]]  # the non-draft token only
    out = s.update_from_output(so, ex.execute(so))[0].outputs[0]
    assert out.new_token_ids[0] == 7 and len(out.new_token_ids) == 2  # accepted draft + bonus token
    assert (r.num_tokens, r.num_computed_tokens) == (8, 7)  # two rejected drafts rolled back
    assert s.schedule().num_scheduled_tokens == {"R": 1}


def test_spec_tokens_trimmed_by_budget_and_stop_inside_drafts():
    s = build(max_num_batched_tokens=3)
    r = add(s, "R", prompt(0, 3), eos_token_id=8)
    ex = ScriptedModelRunner()
    run_steps(s, ex, 1)
    s.update_draft_token_ids({"R": [7, 8, 9, 10]})
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"R": [7, 8]} and so.num_scheduled_tokens == {"R": 3}
    out = s.update_from_output(so, ex.execute(so))[0].outputs[0]
    assert out.new_token_ids == [7, 8] and out.finish_reason == FinishReason.STOP  # bonus token dropped
    assert r.output_token_ids == [1003, 7, 8]


def test_drafts_ignored_during_prefill_and_lookahead_slots_allocated():
    s = build(max_num_batched_tokens=4, num_lookahead_tokens=4, block_size=4)
    r = add(s, "R", prompt(0, 8))
    s.schedule()  # first chunk of 4; lookahead slots make it 2 blocks
    assert len(s.kv_cache_manager.get_block_ids("R")) == 2
    s.update_draft_token_ids({"R": [1, 2]})
    assert r.spec_token_ids == []


# ---------------------------------------------------------------------- executor-facing output
def test_cached_request_data_sends_only_changes():
    s = build(max_num_batched_tokens=8, block_size=4)
    ex = ScriptedModelRunner()
    add(s, "A", prompt(0, 6))
    add(s, "B", prompt(10, 2))
    so = s.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["A", "B"]
    assert so.scheduled_new_reqs[0].block_ids == s.kv_cache_manager.get_block_ids("A")
    s.update_from_output(so, ex.execute(so))
    so = s.schedule()  # A: position 6 (same block), B: position 2 (same block)
    cached = so.scheduled_cached_reqs
    assert cached.req_ids == ["A", "B"] and cached.new_block_ids == [None, None]
    assert cached.num_computed_tokens == [6, 2] and cached.num_output_tokens == [1, 1]
    assert cached.new_token_ids == [[1006], [1002]] and cached.all_token_ids == {}
    s.update_from_output(so, ex.execute(so))
    s.update_draft_token_ids({"A": [1, 2, 3, 4, 5, 6, 7]})
    so = s.schedule()  # A takes the whole budget with its drafts: B is skipped
    assert so.num_scheduled_tokens == {"A": 8}
    assert so.scheduled_cached_reqs.new_block_ids[0] is not None
    s.update_from_output(so, ex.execute(so))
    so = s.schedule()
    cached = so.scheduled_cached_reqs
    assert cached.req_ids == ["A", "B"] and set(cached.all_token_ids) == {"B"}
    assert cached.all_token_ids["B"] == s.requests["B"].all_token_ids


def test_resumed_request_comes_as_new_request_data_with_outputs():
    s = build(num_blocks=5, block_size=4, max_num_batched_tokens=32)
    ex = ScriptedModelRunner()
    add(s, "A", prompt(100, 7), max_tokens=3)
    add(s, "B", prompt(200, 7))
    run_steps(s, ex, 2)
    so = s.schedule()
    assert so.preempted_req_ids == {"B"} and so.num_scheduled_tokens == {"A": 1}
    s.update_from_output(so, ex.execute(so))  # A finishes (3 tokens)
    so = s.schedule()
    (new,) = so.scheduled_new_reqs
    b = s.requests["B"]
    # B's first block survived in the prefix cache (its tail block was reused by A).
    assert new.req_id == "B" and new.num_computed_tokens == 4 and new.output_token_ids == [1007, 1008]
    assert so.num_scheduled_tokens == {"B": 5} and b.num_preemptions == 1
    assert so.finished_req_ids == {"A"}


def test_outputs_grouped_by_client_with_finished_sets():
    s = build()
    ex = ScriptedModelRunner()
    add(s, "A", prompt(0, 3), client_index=0, max_tokens=1)
    add(s, "B", prompt(10, 3), client_index=1, max_tokens=2)
    so = s.schedule()
    out = s.update_from_output(so, ex.execute(so))
    assert set(out) == {0, 1}
    assert out[0].finished_requests == {"A"} and out[1].finished_requests is None
    assert out[1].outputs[0].finish_reason is None


def test_prefill_chunk_without_tokens_gives_no_output():
    s = build(max_num_batched_tokens=4)
    add(s, "A", prompt(0, 10))
    so = s.schedule()
    assert s.update_from_output(so, make_model_runner_output(so)) == {}
    assert s.requests["A"].is_prefill_chunk


def test_events_and_stats():
    now = [10.0]
    s = Scheduler(make_config(), 100, log_stats=True, clock=lambda: now[0], step_observer=None)
    a = add(s, "A", prompt(0, 3))
    assert [e.type for e in a.events] == [EngineCoreEventType.QUEUED]
    now[0] = 11.0
    so = s.schedule()
    out = s.update_from_output(so, ScriptedModelRunner().execute(so))
    (o,) = out[0].outputs
    assert [(e.type, e.timestamp) for e in o.events] == [
        (EngineCoreEventType.QUEUED, 10.0),
        (EngineCoreEventType.SCHEDULED, 11.0),
    ]
    stats = out[0].scheduler_stats
    assert stats is not None and (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 0)
    assert 0 < stats.kv_cache_usage < 1 and stats.step_counter == 1
    assert build().make_stats() is None


def test_reset_prefix_cache():
    s = build(block_size=4)
    ex = ScriptedModelRunner()
    add(s, "A", prompt(0, 9))
    run_steps(s, ex, 1)
    assert s.reset_prefix_cache() is False  # A holds blocks
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    a = s.requests["A"]
    assert a.status == RequestStatus.PREEMPTED and s.kv_cache_manager.num_cached_blocks == 0
    so = s.schedule()
    assert so.preempted_req_ids == {"A"} and [n.req_id for n in so.scheduled_new_reqs] == ["A"]
    assert so.num_scheduled_tokens == {"A": 10}  # no hit left: full recompute


def test_model_runner_output_for_unknown_rows_is_tolerated():
    s = build()
    add(s, "A", prompt(0, 3))
    so = s.schedule()
    assert s.update_from_output(so, ModelRunnerOutput.empty()) == {}
    assert s.requests["A"].num_computed_tokens == 3
