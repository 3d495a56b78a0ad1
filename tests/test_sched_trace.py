"""Scheduler tracing through the per-step observer hook, and the request queues."""

from __future__ import annotations

import importlib
import json

import pytest

from vllite import plugin_manager
from vllite.plugins.step_observers import sched_trace as trace
from vllite.policies.priority_queue import PriorityRequestQueue, create_request_queue
from vllite.sched import FCFSRequestQueue, create_scheduler
from vllite.testing import ScriptedModelRunner, make_config, make_request


@pytest.fixture
def fresh_plugins(monkeypatch):
    monkeypatch.setattr(
        plugin_manager, "BUILTIN_PLUGINS", ("vllite.policies.builtin", "vllite.plugins.step_observers.sched_trace")
    )

    def make():
        manager = plugin_manager.PluginManager(load_entry_points=False)
        monkeypatch.setattr(plugin_manager, "_manager", manager)
        return manager

    return make


def run(s, steps: int) -> None:
    ex = ScriptedModelRunner()
    for _ in range(steps):
        so = s.schedule()
        s.update_from_output(so, ex.execute(so))


def test_tracing_off_means_no_observer(fresh_plugins, monkeypatch):
    monkeypatch.delenv(trace.TRACE_PATH_ENV, raising=False)
    importlib.reload(trace)
    fresh_plugins()
    assert plugin_manager.get_hook_caller("vllite_step_observer") is None
    assert create_scheduler(make_config(), 10).step_observer is None


def test_trace_env_writes_one_json_line_per_step(fresh_plugins, monkeypatch, tmp_path):
    path = tmp_path / "sub" / "trace.jsonl"
    monkeypatch.setenv(trace.TRACE_PATH_ENV, str(path))
    try:
        importlib.reload(trace)
        fresh_plugins()
        s = create_scheduler(make_config(block_size=4, max_num_batched_tokens=16), 8)  # 7 usable blocks
        base = list(range(100, 109))
        s.add_request(make_request(s, "A", base, max_tokens=1))
        run(s, 1)
        s.add_request(make_request(s, "B", [*base, 5, 6, 7, 8], max_tokens=6))
        s.add_request(make_request(s, "C", list(range(300, 307)), max_tokens=50))
        run(s, 10)  # C is preempted when the blocks run out, and resumed once B is done
        s.shutdown()
    finally:
        assert trace.tracer is not None
        trace.tracer.close()
        monkeypatch.delenv(trace.TRACE_PATH_ENV)
        importlib.reload(trace)
    fresh_plugins()
    assert plugin_manager.get_hook_caller("vllite_step_observer") is None  # the reload left no stale hook
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 12))
    first, second = records[0], records[1]
    assert first["new"] == {"A": 9} and first["prefix_hits"] == {"A": 0}
    assert second["new"] == {"B": 5, "C": 7} and second["prefix_hits"] == {"B": 8, "C": 0}
    assert {"num_waiting", "num_running", "free_blocks", "cached_blocks", "resumed", "running", "preempted"} <= set(
        second
    )
    preempting = [r for r in records if r["preempted"]]
    assert preempting and all(r["new"] == {} and r["resumed"] == {} for r in preempting)
    assert any(r["resumed"] for r in records)


def test_step_tracer_as_plugin_object(fresh_plugins, tmp_path):
    manager = fresh_plugins()
    tracer = trace.StepTracer(tmp_path / "t.jsonl")
    manager.register(tracer, name="tracer")
    try:
        s = create_scheduler(make_config(), 20)
        s.add_request(make_request(s, "A", [1, 2, 3], max_tokens=2))
        run(s, 3)
    finally:
        tracer.close()
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert [json.loads(x)["running"] for x in lines] == [{}, {"A": 1}, {}]


# ---------------------------------------------------------------------- queues
def req(rid: str, priority: int = 0, arrival: float = 0.0):
    return make_request(type("S", (), {"block_hasher": None})(), rid, [1], priority=priority, arrival_time=arrival)


def test_fcfs_queue():
    q = create_request_queue("fcfs")
    assert isinstance(q, FCFSRequestQueue) and not q
    a, b, c, d = (req(x) for x in "abcd")
    q.add_request(a)
    q.add_request(b)
    q.prepend_request(c)
    assert [r.request_id for r in q] == ["c", "a", "b"] and q.peek_request() is c
    e = req("e")
    q.prepend_requests([d, e])  # the last one given ends up first
    q.remove_request(a)
    assert [r.request_id for r in q] == ["e", "d", "c", "b"] and len(q) == 4
    q.remove_request(e)
    q.remove_requests([b, req("x")])
    assert q.pop_request() is d and q.pop_request() is c
    with pytest.raises(IndexError, match="empty"):
        q.pop_request()
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(ValueError):
        q.remove_request(a)


def test_priority_queue_orders_by_priority_arrival_and_id():
    q = create_request_queue("priority")
    assert isinstance(q, PriorityRequestQueue)
    items = [req("e", 5), req("b", 1, 2.0), req("a", 1, 2.0), req("c", 1, 1.0), req("z", 0, 9.0), req("d", 8)]
    for r in items:
        q.add_request(r)
    assert [r.request_id for r in q] == ["z", "c", "a", "b", "e", "d"]
    q.remove_request(items[0])
    q.prepend_request(req("y", 0, 10.0))  # no head to jump to: heap position
    assert [q.pop_request().request_id for _ in range(len(q))] == ["z", "y", "c", "a", "b", "d"]
    with pytest.raises(IndexError, match="empty heap"):
        q.peek_request()
    with pytest.raises(ValueError, match="Unknown scheduling policy"):
        create_request_queue("lottery")
