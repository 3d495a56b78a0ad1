"""A vllite plugin: shortest-prompt-first admission, as one overridden policy decision."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any

from vllite import hookimpl
from vllite.request import Request
from vllite.sched import RequestQueue, Scheduler


class ShortestPromptQueue(RequestQueue):
    """Admits preempted requests first (in the order they were put back), then the shortest prompt."""

    def __init__(self) -> None:
        self._resumed: deque[Request] = deque()
        self._heap: list[tuple[int, int, Request]] = []
        self._tie = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.num_prompt_tokens, next(self._tie), request))

    def prepend_request(self, request: Request) -> None:
        self._resumed.appendleft(request)

    def peek_request(self) -> Request:
        if self._resumed:
            return self._resumed[0]
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][2]

    def pop_request(self) -> Request:
        if self._resumed:
            return self._resumed.popleft()
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[2]

    def remove_request(self, request: Request) -> None:
        for i, queued in enumerate(self._resumed):
            if queued is request:
                del self._resumed[i]
                return
        for i, entry in enumerate(self._heap):
            if entry[2] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{request.request_id} is not waiting")

    def __len__(self) -> int:
        return len(self._resumed) + len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        yield from self._resumed
        yield from (entry[2] for entry in sorted(self._heap, key=lambda e: (e[0], e[1])))


class ShortestPromptScheduler(Scheduler):
    """vLLM V1's token-budget scheduler, admitting the shortest waiting prompt first."""

    def create_waiting_queue(self) -> RequestQueue:
        return ShortestPromptQueue()


@hookimpl
def vllite_register_schedulers(register: Any) -> None:
    register("shortest-prompt", ShortestPromptScheduler)
