"""``priority``: lower ``priority`` values first, then earlier arrivals (vLLM's ``--scheduling-policy priority``)."""

from __future__ import annotations

from collections.abc import Sequence

from vllite.policies.priority_queue import PriorityRequestQueue
from vllite.request import Request
from vllite.sched import RequestQueue, Scheduler


class PriorityScheduler(Scheduler):
    """Admits the waiting request with the lowest ``(priority, arrival_time, request_id)``; when a running request
    needs KV blocks, preempts the running request with the worst ``(priority, arrival_time)`` — possibly one
    already scheduled this step, whose tokens and blocks the algorithm then refunds. Running requests are never
    preempted to admit waiting ones."""

    def create_waiting_queue(self) -> RequestQueue:
        """A heap on ``(priority, arrival_time, request_id)``."""
        return PriorityRequestQueue()

    def select_preemption_victim(self, running: Sequence[Request], request: Request) -> Request:
        """The largest ``(priority, arrival_time)``; among equals the latest admitted."""
        victim = running[-1]
        worst = (victim.priority, victim.arrival_time)
        for candidate in reversed(running):
            key = (candidate.priority, candidate.arrival_time)
            if key > worst:
                victim, worst = candidate, key
        return victim
