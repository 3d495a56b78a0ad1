"""Which data-parallel engine gets a request: least loaded, the rank it names, or the engine its prefix/job uses.

``DPRouter`` is plain bookkeeping (no sockets, no threads of its own; a lock makes it safe to call from the
frontend and from the engines' output threads), so it can be tested with synthetic stats:

* **least loaded** (``dp_routing="load"``, the default): the live engine with the lowest
  ``(waiting + sent) * 4 + running`` — vLLM's score — where ``waiting``/``running`` are the counts in the latest
  ``SchedulerStats`` the engine published with its outputs and ``sent`` the requests this client sent it since;
  ``waiting + sent`` is raised to this client's requests in flight there that those stats do not show running,
  since stats computed before some sends reached the engine would otherwise drop them (a burst of submissions, as
  ``LLM.generate`` makes, split 157/99 between two engines that way); ties go round-robin;
* **a named rank**: ``EngineCoreRequest.data_parallel_rank``, or ``SamplingParams.extra_args["data_parallel_rank"]``
  (how the server's ``vllm_xargs`` carry it);
* **affinity**: every request of one Continuum job (``extra_args["job_id"]``) goes to the engine its first turn
  went to, so the KV it pinned is found; with ``dp_routing="prefix"`` so does every request whose first prompt
  block (and cache salt) was seen before. The first request of a job or prefix goes to the least-loaded engine.
  An affinity whose engine died is re-assigned.

The router also remembers which engine owns each request in flight (aborts go there; when an engine dies its
requests are the ones that fail) until the engine reports it finished.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from vllite.exceptions import EngineDeadError
from vllite.protocol import EngineCoreOutputs, EngineCoreRequest

ROUTING_MODES = ("load", "prefix")
#: Affinity entries kept (least recently used dropped first).
DEFAULT_AFFINITY_CAPACITY = 65536
#: vLLM's weight of a waiting request against a running one.
WAITING_WEIGHT = 4


@dataclass
class EngineLoad:
    """What the router knows of one engine's load."""

    waiting: int = 0
    running: int = 0
    sent: int = 0  # requests sent since the engine's latest stats
    in_flight: set[str] = field(default_factory=set)
    alive: bool = True

    @property
    def score(self) -> int:
        """vLLM's load score: waiting requests weigh four times running ones (see the module docstring)."""
        waiting = max(self.waiting + self.sent, len(self.in_flight) - self.running)
        return waiting * WAITING_WEIGHT + self.running


class DPRouter:
    """Routes requests among ``num_engines`` engines (see the module docstring) and tracks who owns what."""

    def __init__(
        self,
        num_engines: int,
        *,
        routing: str = "load",
        block_size: int = 16,
        affinity_capacity: int = DEFAULT_AFFINITY_CAPACITY,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}.")
        if routing not in ROUTING_MODES:
            raise ValueError(f"dp_routing must be one of {', '.join(ROUTING_MODES)}, got {routing!r}.")
        self.routing = routing
        self.block_size = block_size
        self.engines = [EngineLoad() for _ in range(num_engines)]
        self._owner: dict[str, int] = {}
        self._affinity: OrderedDict[Hashable, int] = OrderedDict()
        self._affinity_capacity = affinity_capacity
        self._next_tie = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ routing
    def route(self, request: EngineCoreRequest) -> int:
        """Picks the engine for ``request`` and records it as in flight there; a session's later input chunk goes
        to the engine that holds the session. Raises ``EngineDeadError`` when no engine (or the named one) is alive,
        ``ValueError`` for a rank out of range."""
        with self._lock:
            engine = self._owner.get(request.request_id) if request.continuation else None
            if engine is None:
                engine = self._choose(request)
            load = self.engines[engine]
            load.sent += 1
            load.in_flight.add(request.request_id)
            self._owner[request.request_id] = engine
            return engine

    def _choose(self, request: EngineCoreRequest) -> int:
        rank = requested_rank(request)
        if rank is not None:
            if not 0 <= rank < len(self.engines):
                raise ValueError(f"data_parallel_rank must be in [0, {len(self.engines)}), got {rank}.")
            if not self.engines[rank].alive:
                raise EngineDeadError(f"Data-parallel engine {rank}, which the request names, is dead.")
            return rank
        key = self._affinity_key(request)
        if key is not None:
            engine = self._affinity.get(key)
            if engine is not None and self.engines[engine].alive:
                self._affinity.move_to_end(key)
                return engine
            engine = self._least_loaded()
            self._affinity[key] = engine
            self._affinity.move_to_end(key)
            while len(self._affinity) > self._affinity_capacity:
                self._affinity.popitem(last=False)
            return engine
        return self._least_loaded()

    def _affinity_key(self, request: EngineCoreRequest) -> Hashable | None:
        params = request.sampling_params
        extra = params.extra_args if params is not None else None
        if extra and extra.get("job_id") is not None:
            return ("job", str(extra["job_id"]))
        if self.routing == "prefix" and request.prompt_token_ids:
            return ("prefix", request.cache_salt, tuple(request.prompt_token_ids[: self.block_size]))
        return None

    def _least_loaded(self) -> int:
        live = [i for i, load in enumerate(self.engines) if load.alive]
        if not live:
            raise EngineDeadError("Every data-parallel engine core is dead.")
        n = len(self.engines)
        # Lowest score; among equals the first at or after the round-robin cursor.
        best = min(live, key=lambda i: (self.engines[i].score, (i - self._next_tie) % n))
        self._next_tie = (best + 1) % n
        return best

    # ------------------------------------------------------------------ bookkeeping
    def owner(self, request_id: str) -> int | None:
        """The engine a request in flight was sent to (None once finished, failed or unknown)."""
        with self._lock:
            return self._owner.get(request_id)

    def group_by_owner(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Request ids in flight, grouped by the engine that owns them (unknown ids are left out)."""
        groups: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                engine = self._owner.get(request_id)
                if engine is not None:
                    groups.setdefault(engine, []).append(request_id)
        return groups

    def forget(self, request_id: str) -> None:
        """Drops a request that was routed but never reached its engine."""
        with self._lock:
            engine = self._owner.pop(request_id, None)
            if engine is not None:
                load = self.engines[engine]
                load.in_flight.discard(request_id)
                load.sent = max(0, load.sent - 1)

    def on_outputs(self, engine: int, outputs: EngineCoreOutputs) -> None:
        """Takes an engine's published load (its ``scheduler_stats``) and forgets the requests it finished."""
        with self._lock:
            load = self.engines[engine]
            stats = outputs.scheduler_stats
            if stats is not None:
                load.waiting, load.running, load.sent = stats.num_waiting_reqs, stats.num_running_reqs, 0
            finished = [output.request_id for output in outputs.outputs if output.finished]
            if outputs.finished_requests:
                finished.extend(outputs.finished_requests)
            for request_id in finished:
                if self._owner.get(request_id) == engine:
                    del self._owner[request_id]
                    load.in_flight.discard(request_id)

    def mark_dead(self, engine: int) -> list[str]:
        """Takes an engine out of routing; returns the requests it owned (they fail), now forgotten."""
        with self._lock:
            load = self.engines[engine]
            load.alive = False
            failed = sorted(load.in_flight)
            load.in_flight.clear()
            load.waiting = load.running = load.sent = 0
            for request_id in failed:
                self._owner.pop(request_id, None)
            return failed

    def live_engines(self) -> list[int]:
        """Indices of the engines still alive."""
        with self._lock:
            return [i for i, load in enumerate(self.engines) if load.alive]


def requested_rank(request: EngineCoreRequest) -> int | None:
    """The engine a request names: ``data_parallel_rank`` on the request, else in its ``extra_args``."""
    if request.data_parallel_rank is not None:
        return request.data_parallel_rank
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    if extra and extra.get("data_parallel_rank") is not None:
        value = extra["data_parallel_rank"]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"data_parallel_rank must be an integer, got {value!r}.")
        return value
    return None
