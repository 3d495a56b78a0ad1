"""``fcfs``: first come, first served — the base ``Scheduler``'s own decisions, named explicitly."""

from __future__ import annotations

from collections.abc import Sequence

from vllite.request import Request
from vllite.sched import FCFSRequestQueue, RequestQueue, Scheduler


class FCFSScheduler(Scheduler):
    """Admits in arrival order; preempted requests go back to the head of the queue; the victim is the request
    admitted last (``running[-1]``), which was never scheduled ahead of the request needing room."""

    def create_waiting_queue(self) -> RequestQueue:
        """A deque in arrival order."""
        return FCFSRequestQueue()

    def select_preemption_victim(self, running: Sequence[Request], request: Request) -> Request:
        """The last admitted running request (LIFO)."""
        return running[-1]
