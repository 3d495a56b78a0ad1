"""Preemption by recompute under FCFS, priority and a test plugin's victim choice, and scheduler resolution
through the plugin manager."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from vllite import plugin_manager
from vllite.exceptions import PluginLoadError, UnknownComponentError
from vllite.hookspecs import hookimpl
from vllite.policies.fcfs import FCFSScheduler
from vllite.policies.priority import PriorityScheduler
from vllite.request import Request, RequestStatus
from vllite.sched import Scheduler, create_scheduler
from vllite.testing import ScriptedModelRunner, make_config, make_request


@pytest.fixture
def plugins(monkeypatch):
    """A plugin manager with only the scheduler builtins (hermetic: no entry points, no other builtins)."""
    monkeypatch.setattr(
        plugin_manager, "BUILTIN_PLUGINS", ("vllite.policies.builtin", "vllite.plugins.step_observers.sched_trace")
    )
    manager = plugin_manager.PluginManager(load_entry_points=False)
    monkeypatch.setattr(plugin_manager, "_manager", manager)
    return manager


def build(cls: type[Scheduler], num_blocks: int, **config_kw) -> Scheduler:
    config_kw.setdefault("block_size", 4)
    config_kw.setdefault("max_num_batched_tokens", 64)
    return cls(make_config(**config_kw), num_blocks, step_observer=None)


def add(s: Scheduler, rid: str, n: int, **kw) -> Request:
    kw.setdefault("max_tokens", 100)
    request = make_request(s, rid, list(range(ord(rid[0]) * 100, ord(rid[0]) * 100 + n)), **kw)
    s.add_request(request)
    return request


def step(s: Scheduler, ex: ScriptedModelRunner):
    so = s.schedule()
    s.update_from_output(so, ex.execute(so))
    return so


def three_decoders(cls: type[Scheduler], priorities=(0, 0, 0)) -> tuple[Scheduler, ScriptedModelRunner]:
    """A, B, C with 7-token prompts in 6 usable blocks: after two steps each holds 2 full blocks and needs a
    third for its next token."""
    s = build(cls, num_blocks=7)
    ex = ScriptedModelRunner()
    for i, (rid, prio) in enumerate(zip("ABC", priorities)):
        add(s, rid, 7, priority=prio, arrival_time=float(i))
    assert step(s, ex).num_scheduled_tokens == {"A": 7, "B": 7, "C": 7}
    assert step(s, ex).num_scheduled_tokens == {"A": 1, "B": 1, "C": 1}
    assert s.kv_cache_manager.num_free_blocks == 0
    return s, ex


def test_fcfs_preempts_last_admitted_and_resumes_it_first():
    s, ex = three_decoders(FCFSScheduler)
    a, b, c = (s.requests[r] for r in "ABC")
    add(s, "D", 2)  # would fit after the preemption, but nothing is admitted in a step that preempted
    so = step(s, ex)
    assert so.num_scheduled_tokens == {"A": 1, "B": 1} and so.preempted_req_ids == {"C"}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert s.kv_cache_manager.get_block_ids("C") == []
    assert [r.request_id for r in s.waiting] == ["C", "D"]  # prepended at the head
    s.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    so = step(s, ex)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["C"]  # A's 3 blocks go to C; D must wait
    assert so.num_scheduled_tokens == {"B": 1, "C": 9}
    assert c.output_token_ids == [1007, 1008, 1009]  # generation continues where it stopped
    assert a.status == RequestStatus.FINISHED_ABORTED and b.num_preemptions == 0


def test_priority_preempts_worst_priority_even_the_requester():
    s, ex = three_decoders(PriorityScheduler, priorities=(2, 0, 1))
    # Admission order: B (0), C (1), A (2); A is the worst and is preempted when B needs a block.
    assert [r.request_id for r in s.running] == ["B", "C", "A"]
    so = step(s, ex)
    assert so.preempted_req_ids == {"A"} and so.num_scheduled_tokens == {"B": 1, "C": 1}
    s.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    so = step(s, ex)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["A"] and s.requests["A"].num_preemptions == 1


def test_priority_refunds_an_already_scheduled_victim():
    """V (priority 5) was admitted first and is scheduled first with a prefill chunk; R (priority 0) then needs a
    block, so V is preempted after being scheduled: its tokens go back to the budget, it leaves the output, and
    the blocks its chunk would have filled are never registered in the prefix cache."""
    s = build(PriorityScheduler, num_blocks=10, max_num_batched_tokens=14, long_prefill_token_threshold=10)
    ex = ScriptedModelRunner()
    v = add(s, "V", 30, priority=5)
    assert step(s, ex).num_scheduled_tokens == {"V": 10}
    r = add(s, "R", 4, priority=0, arrival_time=1.0)
    assert step(s, ex).num_scheduled_tokens == {"V": 10, "R": 4}
    assert s.kv_cache_manager.num_free_blocks == 3
    so = step(s, ex)
    assert so.num_scheduled_tokens == {"R": 1} and so.total_num_scheduled_tokens == 1
    assert so.preempted_req_ids == {"V"} and so.scheduled_cached_reqs.req_ids == ["R"]
    assert v.num_computed_tokens == 0 and [x.request_id for x in s.running] == ["R"]
    # Only V's 20 computed tokens (5 blocks) are reusable; the chunk 20..29 was never computed.
    _, num_hit = s.kv_cache_manager.get_computed_blocks(v)
    assert num_hit == 20
    assert r.num_computed_tokens == 5


def test_priority_victim_before_the_cursor_does_not_skip_the_next_request():
    """vLLM's priority regression: V (priority 9) runs first; B (0) needs a block and V, already scheduled, is
    preempted. The list shrinks ahead of the cursor, and C (1), behind B, must still be scheduled. V's prompt
    alone outgrows the cache: admitted chunk by chunk (no full-sequence gate), it runs until it is the victim."""
    s = build(
        PriorityScheduler,
        num_blocks=9,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        scheduler_reserve_full_isl=False,
    )
    ex = ScriptedModelRunner()
    add(s, "V", 40, priority=9)
    step(s, ex)
    add(s, "B", 4, priority=0, arrival_time=1.0)
    add(s, "C", 4, priority=1, arrival_time=2.0)
    assert step(s, ex).num_scheduled_tokens == {"V": 8, "B": 4, "C": 4}
    so = step(s, ex)
    assert so.preempted_req_ids == {"V"} and so.num_scheduled_tokens == {"B": 1, "C": 1}
    assert [r.request_id for r in s.running] == ["B", "C"] and [r.request_id for r in s.waiting] == ["V"]


class LeastComputedFirst(Scheduler):
    """Test policy: preempt the running request with the fewest computed tokens (never the requester unless
    it is alone). Only the victim choice changes."""

    def select_preemption_victim(self, running: Sequence[Request], request: Request) -> Request:
        others = [r for r in running if r is not request] or [request]
        return min(others, key=lambda r: r.num_computed_tokens)


class VictimPlugin:
    @hookimpl
    def vllite_register_schedulers(self, register):
        register("lcf", LeastComputedFirst)


def lcf_scenario(s: Scheduler) -> list:
    """A (5), B (3), C (7) in 6 usable blocks: on step 3, B takes the last free block and C needs one more."""
    ex = ScriptedModelRunner()
    add(s, "A", 5)
    add(s, "B", 3)
    add(s, "C", 7)
    step(s, ex)
    step(s, ex)
    so = step(s, ex)
    return [so.num_scheduled_tokens, so.preempted_req_ids]


def test_plugin_changing_only_the_victim_is_selected_by_name(plugins):
    plugins.register(VictimPlugin(), name="victim-plugin")
    config = make_config(block_size=4, max_num_batched_tokens=64, scheduler_cls="lcf")
    s = create_scheduler(config, 7)
    assert type(s) is LeastComputedFirst
    # LCF preempts B, already scheduled this step (refunded); FCFS makes C preempt itself.
    assert lcf_scenario(s) == [{"A": 1, "C": 1}, {"B"}]
    assert lcf_scenario(build(FCFSScheduler, num_blocks=7)) == [{"A": 1, "B": 1}, {"C"}]


def test_create_scheduler_by_policy_name_and_class_path(plugins):
    assert type(create_scheduler(make_config(), 10)) is FCFSScheduler
    assert type(create_scheduler(make_config(scheduling_policy="priority"), 10)) is PriorityScheduler
    for path in ("vllite.policies.priority:PriorityScheduler", "vllite.policies.priority.PriorityScheduler"):
        assert type(create_scheduler(make_config(scheduler_cls=path), 10)) is PriorityScheduler
    assert create_scheduler(make_config(), 10, log_stats=True).make_stats() is not None
    with pytest.raises(UnknownComponentError, match="fcfs"):
        create_scheduler(make_config(scheduler_cls="nope"), 10)
    with pytest.raises(PluginLoadError, match=r"not a vllite\.sched\.SchedulerInterface"):
        create_scheduler(make_config(scheduler_cls="vllite.request:Request"), 10)


def test_full_interface_implementation_by_class_path(plugins, monkeypatch):
    """A class path to a SchedulerInterface implementation that is not a Scheduler subclass also works."""
    import sys
    import types

    from vllite.sched import SchedulerInterface

    class Minimal(SchedulerInterface):
        def __init__(self, config, num_blocks, *, log_stats=False, clock=None):
            self.num_blocks = num_blocks

        add_request = schedule = update_from_output = finish_requests = lambda *a, **k: None
        get_num_unfinished_requests = get_request_counts = has_finished_requests = lambda *a: 0
        set_pause_state = reset_prefix_cache = make_stats = lambda *a, **k: None
        update_draft_token_ids = shutdown = lambda *a, **k: None
        pause_state = property(lambda self: 0)

    module = types.ModuleType("sched_plugin_mod")
    module.Minimal = Minimal
    monkeypatch.setitem(sys.modules, "sched_plugin_mod", module)
    s = create_scheduler(make_config(scheduler_cls="sched_plugin_mod:Minimal"), 12)
    assert isinstance(s, Minimal) and s.num_blocks == 12 and not s.has_requests()
