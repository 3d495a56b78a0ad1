"""The example plugin orders admission by prompt length and is found through its entry point."""

from __future__ import annotations

import subprocess
import sys

from vllite_shortest_prompt import ShortestPromptQueue, ShortestPromptScheduler

from vllite.request import RequestStatus
from vllite.testing import make_config, make_request


def _scheduler(**kw):
    return ShortestPromptScheduler(make_config(**kw), num_blocks=64)


def test_queue_order():
    scheduler = _scheduler()
    queue = ShortestPromptQueue()
    long, short, mid = (make_request(scheduler, name, [7] * n) for name, n in (("long", 30), ("short", 3), ("mid", 10)))
    for request in (long, short, mid):
        queue.add_request(request)
    resumed = make_request(scheduler, "resumed", [7] * 50)
    queue.prepend_request(resumed)  # a preempted request comes back first
    assert [r.request_id for r in queue] == ["resumed", "short", "mid", "long"]
    assert [queue.pop_request().request_id for _ in range(4)] == ["resumed", "short", "mid", "long"]
    assert len(queue) == 0


def test_scheduler_admits_shortest_first():
    scheduler = _scheduler(max_num_seqs=1)
    for request_id, length in (("a", 40), ("b", 5), ("c", 12)):
        scheduler.add_request(make_request(scheduler, request_id, [9] * length))
    output = scheduler.schedule()
    assert [r.req_id for r in output.scheduled_new_reqs] == ["b"]
    assert scheduler.requests["a"].status == RequestStatus.WAITING


def test_listed_by_vllite_plugins():
    out = subprocess.run([sys.executable, "-m", "vllite.cli", "plugins"], capture_output=True, text=True, check=True)
    assert "shortest-prompt" in out.stdout and "vllite-shortest-prompt 0.1.0" in out.stdout
