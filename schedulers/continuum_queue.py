"""``ContinuumRequestQueue``: Continuum's admission order (paper §4.3).

Three tiers, each ordered by program-level FCFS — the arrival time of the job's first request, then the
request's own arrival, then insertion order:

0. preempted requests (they were admitted once; as in vLLM they go first);
1. requests of jobs that hold a pin (their prefix is warm, admitting them releases memory soon);
2. everything else.

Each tier is a heap with lazy deletion, so add / pop / peek are O(log n) amortised and a job's pin changing
moves only that job's waiting requests. (The released fork scans the whole queue on every peek and has no
preempted tier.)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence

from vllite.policies.continuum_turns import turn_info
from vllite.request import Request
from vllite.sched import RequestQueue

PREEMPTED, PINNED, NORMAL = 0, 1, 2

# [job_arrival, arrival_time, seq, request-or-None]; None marks a deleted entry.
_Entry = list


class ContinuumRequestQueue(RequestQueue):
    """Preempted first, then requests of pinned jobs, then program-level FCFS.

    Promises: ``peek_request`` is the request ``pop_request`` returns; ``__iter__`` lists requests in that order;
    :meth:`set_job_pinned` re-tiers the job's waiting requests at once; :meth:`has_job` tells whether a job has a
    request waiting, in O(1).
    """

    def __init__(self) -> None:
        self._heaps: tuple[list[_Entry], list[_Entry], list[_Entry]] = ([], [], [])
        self._entries: dict[int, tuple[int, _Entry]] = {}  # id(request) -> (tier, entry)
        self._by_job: dict[str, dict[int, Request]] = {}  # waiting requests per job
        self._pinned_jobs: set[str] = set()
        self._seq = itertools.count()
        self._num_dead = 0

    # ------------------------------------------------------------------ pin state
    def set_job_pinned(self, job_id: str, pinned: bool) -> None:
        """Records whether ``job_id`` holds a pin; its non-preempted waiting requests change tier."""
        if pinned:
            self._pinned_jobs.add(job_id)
        else:
            self._pinned_jobs.discard(job_id)
        tier = PINNED if pinned else NORMAL
        for request in list(self._by_job.get(job_id, {}).values()):
            old_tier, _ = self._entries[id(request)]
            if old_tier != PREEMPTED and old_tier != tier:
                self._delete(request)
                self._push(request, tier)

    def has_job(self, job_id: str) -> bool:
        """Whether a request of ``job_id`` is waiting."""
        return job_id in self._by_job

    # ------------------------------------------------------------------ RequestQueue
    def add_request(self, request: Request) -> None:
        job_id = turn_info(request).job_id
        self._push(request, PINNED if job_id is not None and job_id in self._pinned_jobs else NORMAL)

    def prepend_request(self, request: Request) -> None:
        self._push(request, PREEMPTED)

    def requeue_skipped(self, requests: Sequence[Request]) -> None:
        """Back into the tier each came from: preempted requests (they ran before) to the first, others by their
        job's pin."""
        for request in requests:
            if request.num_preemptions:
                self.prepend_request(request)
            else:
                self.add_request(request)

    def peek_request(self) -> Request:
        for heap in self._heaps:
            while heap and heap[0][-1] is None:
                heapq.heappop(heap)
                self._num_dead -= 1
            if heap:
                return heap[0][-1]
        raise IndexError("peek from an empty queue")

    def pop_request(self) -> Request:
        request = self.peek_request()
        self._delete(request)
        return request

    def remove_request(self, request: Request) -> None:
        if id(request) not in self._entries:
            raise ValueError(f"request {request.request_id!r} is not in the queue")
        self._delete(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            if id(request) in self._entries:
                self._delete(request)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request: object) -> bool:
        entry = self._entries.get(id(request))
        return entry is not None and entry[1][-1] is request

    def __iter__(self) -> Iterator[Request]:
        live = sorted((tier, entry[:-1], entry[-1]) for tier, entry in self._entries.values())
        return iter([request for _, _, request in live])

    # ------------------------------------------------------------------ internals
    def _push(self, request: Request, tier: int) -> None:
        info = turn_info(request)
        entry: _Entry = [info.job_arrival, request.arrival_time, next(self._seq), request]
        heapq.heappush(self._heaps[tier], entry)
        self._entries[id(request)] = (tier, entry)
        if info.job_id is not None:
            self._by_job.setdefault(info.job_id, {})[id(request)] = request

    def _delete(self, request: Request) -> None:
        _tier, entry = self._entries.pop(id(request))
        entry[-1] = None
        self._num_dead += 1
        job_id = turn_info(request).job_id
        if job_id is not None:
            waiting = self._by_job[job_id]
            del waiting[id(request)]
            if not waiting:
                del self._by_job[job_id]
        if self._num_dead > 64 and self._num_dead > len(self._entries):
            self._compact()

    def _compact(self) -> None:
        for heap in self._heaps:
            heap[:] = [entry for entry in heap if entry[-1] is not None]
            heapq.heapify(heap)
        self._num_dead = 0
