"""Waiting queues: the order in which the scheduler admits requests.

``FCFSRequestQueue``, the algorithm's default, admits in arrival order and puts preempted requests back at the
head. A policy with its own order subclasses :class:`RequestQueue` and returns it from
``Scheduler.create_waiting_queue`` (the ``priority`` policy's heap is ``vllite.policies.priority_queue``, Continuum's
program-level order ``vllite.policies.continuum_queue``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from vllite import deprecated_aliases
from vllite.request import Request


class RequestQueue(ABC):
    """A queue of waiting requests; ``peek_request`` is what the scheduler would admit next."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Adds a newly arrived request in the queue's order."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Removes and returns the next request; ``IndexError`` when empty."""

    @abstractmethod
    def peek_request(self) -> Request:
        """Returns the next request without removing it; ``IndexError`` when empty."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Puts back a request that was already admitted once (preempted): as early as the order allows."""

    @abstractmethod
    def remove_request(self, request: Request) -> None:
        """Removes one request (abort, or stop of a preempted request); ``ValueError`` if absent."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests in admission order (a snapshot)."""

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Prepends each request in turn (for FCFS the last one given ends up first)."""
        for request in requests:
            self.prepend_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Removes several requests; absent ones are ignored."""
        for request in requests:
            if request in self:
                self.remove_request(request)

    def requeue_skipped(self, requests: Sequence[Request]) -> None:
        """Puts back requests that admission popped from the head in this order and set aside (blocked on a KV
        load, or deferred by the KV connector), so that the queue's order is as before.

        Default: ``prepend_request`` in reverse, which restores the order of a queue whose prepend puts a request at
        its head (FCFS) or in its sorted place (priority). A queue whose ``prepend_request`` means more than that
        (e.g. a tier for preempted requests) overrides this.
        """
        for request in reversed(requests):
            self.prepend_request(request)


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque; preempted requests go back to the head. All operations O(1) except
    removal from the middle."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty queue")
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove_request(self, request: Request) -> None:
        for i, queued in enumerate(self._queue):
            if queued is request:
                del self._queue[i]
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        if drop:
            self._queue = deque(r for r in self._queue if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)  # the priority heap, now the priority policy's
