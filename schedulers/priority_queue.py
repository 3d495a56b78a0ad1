"""``PriorityRequestQueue``: the ``priority`` policy's waiting order, a heap on ``(priority, arrival_time, id)``."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from vllite.request import Request
from vllite.sched import FCFSRequestQueue, RequestQueue


class PriorityRequestQueue(RequestQueue):
    """A min-heap on ``(priority, arrival_time, request_id)``: lower priority values run first, then earlier
    arrivals. There is no head to prepend to, so a preempted request simply re-enters in its heap position.
    Push and pop are O(log n); removal is O(n)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, int, Request]] = []
        self._tiebreak = itertools.count()

    def _entry(self, request: Request) -> tuple[int, float, str, int, Request]:
        return (request.priority, request.arrival_time, request.request_id, next(self._tiebreak), request)

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, self._entry(request))

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from empty heap")
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from empty heap")
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_request(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[-1] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        if drop:
            self._heap = [e for e in self._heap if id(e[-1]) not in drop]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))

    def __contains__(self, request: object) -> bool:
        return any(entry[-1] is request for entry in self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue of the builtin policy ``fcfs`` or ``priority`` (vLLM's function of that name)."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"Unknown scheduling policy: {policy!r} (known: fcfs, priority).")
