"""``continuum``: KV-cache pinning across tool calls with program-level FCFS (Continuum, arXiv 2511.02230).

When a non-last turn of an agent job finishes, the job is about to run a tool and send its next turn, whose
prompt extends this turn's tokens. Instead of freeing the turn's KV blocks, the scheduler keeps them (holds
their reference counts) for a TTL from the tool-call estimator, so the next turn hits them through the prefix
cache (``get_computed_blocks``) instead of recomputing and re-queueing. All of it is policy methods of the base
algorithm; ``schedule()`` is untouched.

Decisions (paper §4, with the released fork's bugs fixed; see docs/scheduler-policies.md):

- Pin only a turn that stopped or hit its length cap, has a job id, is not the job's last step, and got a TTL > 0;
  never an aborted or errored one, and never without prefix caching (nothing could hit the blocks).
- At most one pin per job: a newer pin releases the older (shared prefix blocks stay held by the newer one).
  The job's last step releases its pin.
- The pin is released when the job's next turn is admitted (paper Algorithm 1: "delete P[id]"): by then the
  turn holds the shared blocks itself, so only the old turn's unshared tail is freed. ``policy_args
  release_pin_on_admission=False`` keeps it until TTL expiry or the next pin, as the released code does.
- At the top of each step, expired pins (``now >= expiry``) whose job has no request waiting are released.
- When the head of the waiting queue cannot get blocks, pins are released one by one, latest-arriving job first
  (the head's own job last), until it fits or no pin is left.
- When a running request cannot get blocks, pins are released the same way (its own job last) before any running
  request is preempted: a pin is idle memory, a preemption throws away computed work. ``policy_args
  release_pins_before_preemption=False`` preempts at once, keeping the pins (as the released code does whenever
  more than one request runs).
- Preemption victims: requests of unpinned jobs before pinned ones, then the latest-arriving job, then the latest
  admitted. The base algorithm refunds a victim already scheduled this step (the released fork does not).
- Sessions (resumable requests) parked between turns are held for the estimator's TTL of the turn's tool (the base
  idle timeout when no tool is known or the TTL is 0); their next turn's arrival feeds the estimator the tool's
  duration.
- Tool names: ``this_func_call`` from the client wins; otherwise the turn's output is detokenized and parsed if
  a detokenizer is available (``detokenize=`` argument, ``plugin_config["continuum"]["detokenize"]``, or the
  model's tokenizer loaded on first need); otherwise the tool is unknown.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllite.policies.continuum_queue import ContinuumRequestQueue
from vllite.policies.continuum_turns import turn_info
from vllite.policies.estimators import FixedTTLEstimator, UtilityEstimator
from vllite.request import Request, RequestStatus
from vllite.sched import RequestQueue, Scheduler

if TYPE_CHECKING:
    from vllite.config import EngineConfig

logger = logging.getLogger(__name__)

Detokenize = Callable[[list[int]], str]
_PINNABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass(slots=True)
class Pin:
    """A finished turn whose blocks are kept until ``expiry`` (scheduler clock)."""

    request: Request
    job_id: str
    expiry: float
    job_arrival: float
    seq: int


@dataclass(slots=True)
class JobState:
    """What the scheduler keeps per job: its first arrival (program-level FCFS), live requests, last activity."""

    first_arrival: float
    last_seen: float
    live: int = 0


class ContinuumScheduler(Scheduler):
    """The token-budget algorithm with Continuum's policy: TTL pins across tool calls, program-level FCFS.

    Promises: pinned blocks are released by TTL expiry (once the job has nothing waiting), by a newer pin of the
    same job, by the job's next turn being admitted (default), by the job's last step, when the waiting head
    cannot fit or a running request cannot grow (latest job first), or by ``reset_prefix_cache`` / ``shutdown``; so
    the scheduler never deadlocks on pins and, once no pin is live, holds no block for a finished request. Per-job
    state is bounded (``max_jobs``, ``job_idle_timeout_s`` in ``policy_args``). ``clock`` (base argument) times pins
    and tool gaps.

    Extra keyword arguments: ``estimator`` (an object, else ``scheduler_config.tool_call_estimator`` is resolved),
    ``tool_parser`` (an object with ``parse``, else ``policy_args["tool_parser"]``, default ``auto``; ``None`` or
    ``"none"`` disables parsing) and ``detokenize`` (token ids → text).

    ``accepted_policy_args`` holds Continuum's own keys and those of the built-in tool-call estimators; a
    subclass adds the keys of a third-party estimator.
    """

    accepted_policy_args: ClassVar[Mapping[str, str]] = {
        **Scheduler.accepted_policy_args,
        **FixedTTLEstimator.accepted_policy_args,
        **UtilityEstimator.accepted_policy_args,
        "release_pin_on_admission": "release a job's pin when its next turn is admitted (true)",
        "release_pins_before_preemption": "release pins before preempting a running request (true)",
        "max_jobs": "jobs remembered at once (10000)",
        "job_idle_timeout_s": "forget a job idle this long, in seconds (3600)",
        "tool_parser": "registered tool-call parser name, or none (auto)",
        "load_tokenizer": "load the model's tokenizer to parse tool calls (true)",
    }

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        *,
        estimator: Any = None,
        tool_parser: Any = None,
        detokenize: Detokenize | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, num_blocks, **kwargs)
        args = dict(config.scheduler_config.policy_args)
        self.release_pin_on_admission = bool(args.get("release_pin_on_admission", True))
        self.release_pins_before_preemption = bool(args.get("release_pins_before_preemption", True))
        self.max_jobs = int(args.get("max_jobs", 10_000))
        self.job_idle_timeout_s = float(args.get("job_idle_timeout_s", 3600.0))
        self.estimator = estimator if estimator is not None else _build_estimator(config)
        self._record_wait = getattr(self.estimator, "record_queueing_delay", None)
        self._forget_estimator_job = getattr(self.estimator, "forget_job", None)
        parser_name = args.get("tool_parser", "auto")
        if tool_parser is None and parser_name not in (None, "none"):
            from vllite.plugin_manager import resolve_component

            tool_parser = resolve_component("tool_parsers", parser_name)()
        self.tool_parser = tool_parser
        plugin_args = config.plugin_config.get("continuum") or {}
        self._detokenize: Detokenize | None = detokenize or plugin_args.get("detokenize")
        model = config.model_config
        self._tokenizer_path: str | None = (
            None if model.skip_tokenizer_init or not args.get("load_tokenizer", True) else model.tokenizer
        )

        self._pins: dict[str, Pin] = {}
        self._pin_by_request_id: dict[str, str] = {}
        self._expiry_heap: list[tuple[float, int, str]] = []
        self._expired: set[str] = set()  # expired pins kept because their job has a request waiting
        self._pin_seq = itertools.count()
        self._jobs: OrderedDict[str, JobState] = OrderedDict()
        self._next_aging = float("-inf")
        # pinned, expired, replaced, admitted, last_step, deadlock, running_blocked, ...
        self.pin_stats: Counter[str] = Counter()

    # ------------------------------------------------------------------ views
    @property
    def pinned_jobs(self) -> dict[str, float]:
        """``job_id -> expiry`` of the live pins."""
        return {job: pin.expiry for job, pin in self._pins.items()}

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held by pinned requests (shared blocks counted once per pin)."""
        kv = self.kv_cache_manager
        return sum(len(kv.get_block_ids(pin.request.request_id)) for pin in self._pins.values())

    # ------------------------------------------------------------------ policy decisions
    def create_waiting_queue(self) -> RequestQueue:
        """Preempted first, then requests of pinned jobs, then program-level FCFS."""
        return ContinuumRequestQueue()

    def select_preemption_victim(self, running: Sequence[Request], request: Request) -> Request:
        """Unpinned jobs first, then the latest-arriving job, then the latest admitted."""
        pins = self._pins
        victim, worst = running[-1], None
        for index, candidate in enumerate(running):
            info = turn_info(candidate)
            key = (info.job_id not in pins, info.job_arrival, index)
            if worst is None or key > worst:
                victim, worst = candidate, key
        return victim

    def on_request_arrival(self, request: Request) -> None:
        """Records the job's first arrival and the tool gap (estimator); a reused id of a pinned request
        releases that pin first (the KV manager keys blocks by request id)."""
        now = self.clock()
        info = turn_info(request)
        info.arrived_at = now
        stale_job = self._pin_by_request_id.get(request.request_id)
        if stale_job is not None:
            self._release_pin(stale_job, "id_reused")
        job_id = info.job_id
        if job_id is not None:
            state = self._jobs.get(job_id)
            if state is None:
                state = self._jobs[job_id] = JobState(first_arrival=request.arrival_time, last_seen=now)
                self._evict_idle_jobs(now, over_cap=True)
            else:
                self._jobs.move_to_end(job_id)
                state.last_seen = now
                info.evicted = job_id not in self._pins
            state.live += 1
            info.job_arrival = state.first_arrival
        self.estimator.request_arrives(request, now)

    def on_request_admitted(self, request: Request) -> None:
        """Feeds an evicted turn's wait to the estimator; releases the job's pin (unless configured not to)."""
        info = turn_info(request)
        if not info.admitted:
            info.admitted = True
            if info.evicted and self._record_wait is not None:
                self._record_wait(self.clock() - info.arrived_at)
        if self.release_pin_on_admission and info.job_id in self._pins:
            self._release_pin(info.job_id, "admitted")

    def on_request_finished(self, request: Request) -> bool:
        """Pins a pinnable turn for the estimator's TTL (returns False), else frees its blocks (True)."""
        info = turn_info(request)
        job_id = info.job_id
        if job_id is None:
            return super().on_request_finished(request)
        now = self.clock()
        state = self._jobs.get(job_id)
        if state is not None:
            state.live = max(0, state.live - 1)
            state.last_seen = now
        if info.is_last_step:
            if job_id in self._pins:
                self._release_pin(job_id, "last_step")
            super().on_request_finished(request)
            if state is not None and state.live == 0:
                del self._jobs[job_id]
            if self._forget_estimator_job is not None:
                self._forget_estimator_job(job_id)
            return True
        if request.status not in _PINNABLE or not self.enable_caching:
            return super().on_request_finished(request)
        if info.this_func_call is None:
            info.this_func_call = self._parse_tool(request)
        self.estimator.request_finished(request, now)
        ttl = float(self.estimator.set_up_pin(request, now))
        if not ttl > 0.0:  # also rejects NaN
            return super().on_request_finished(request)
        self._pin(request, job_id, now + ttl, info.job_arrival)
        return False

    def session_hold_seconds(self, request: Request) -> float:
        """A session parked between turns is a program whose next turn is known to come: it is held for the
        estimator's TTL of the tool its turn called (the session is the job unless the client named one), or for the
        base idle timeout when no tool is known or the estimator would not pin (TTL 0: a long tool).

        Unlike a pin, a held session costs nothing that others need: its blocks give way to running requests tail
        first (``vllite.sched.sessions``) and only keep new programs waiting, which program-level FCFS wants anyway;
        released, its history would be evicted by the time the long tool returns and all of it recomputed."""
        info = turn_info(request)
        if info.job_id is None:
            info.job_id = request.request_id
        now = self.clock()
        if info.this_func_call is None:
            info.this_func_call = self._parse_tool(request)
        self.estimator.request_finished(request, now)
        if info.this_func_call is None:
            return super().session_hold_seconds(request)
        ttl = float(self.estimator.set_up_pin(request, now))
        return ttl if ttl > 0.0 else super().session_hold_seconds(request)

    def on_session_resumed(self, request: Request) -> None:
        """The session's next turn arrived: the gap since its last turn ended feeds the estimator (the tool's
        duration), and the new turn's tool is unknown until it ends."""
        info = turn_info(request)
        info.last_func_call = info.this_func_call = None  # the estimator takes the tool it recorded at the turn end
        self.estimator.request_arrives(request, self.clock())

    def on_step_start(self) -> None:
        """Releases expired pins whose job has no request waiting; ages out idle jobs."""
        now = self.clock()
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, seq, job_id = heapq.heappop(heap)
            pin = self._pins.get(job_id)
            if pin is not None and pin.seq == seq:
                self._expired.add(job_id)
        if self._expired:
            waiting = self.waiting
            for job_id in [j for j in self._expired if not waiting.has_job(j)]:  # type: ignore[attr-defined]
                self._release_pin(job_id, "expired")
        if self._jobs and now >= self._next_aging:
            self._next_aging = now + 1.0  # idle timeouts are long: once a second is plenty
            self._evict_idle_jobs(now)

    def on_admission_blocked(self, request: Request) -> bool:
        """Releases the pin of the latest-arriving job (the head's own job last); False when nothing is pinned."""
        return self._release_latest_pin(turn_info(request).job_id, "deadlock")

    def on_running_allocation_failed(self, request: Request) -> bool:
        """A running request needs blocks: releases the pin of the latest-arriving job (the request's own job
        last) instead of preempting running work; False when nothing is pinned or ``policy_args
        release_pins_before_preemption`` is off, and the base algorithm then preempts."""
        if not self.release_pins_before_preemption:
            return False
        return self._release_latest_pin(turn_info(request).job_id, "running_blocked")

    # ------------------------------------------------------------------ engine-facing overrides
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Releases every pin first (pinned blocks would make the reset fail), then resets."""
        self.release_all_pins()
        return super().reset_prefix_cache(reset_running_requests)

    def shutdown(self) -> None:
        """Releases every pin."""
        self.release_all_pins()
        super().shutdown()

    def release_all_pins(self) -> None:
        """Frees the blocks of every pinned request."""
        for job_id in list(self._pins):
            self._release_pin(job_id, "released")

    # ------------------------------------------------------------------ internals
    def _pin(self, request: Request, job_id: str, expiry: float, job_arrival: float) -> None:
        old = self._pins.get(job_id)
        pin = Pin(request, job_id, expiry, job_arrival, next(self._pin_seq))
        self._pins[job_id] = pin
        self._pin_by_request_id[request.request_id] = job_id
        heapq.heappush(self._expiry_heap, (expiry, pin.seq, job_id))
        self.pin_stats["pinned"] += 1
        if old is not None:
            # The new pin already holds the shared prefix: freeing the old one drops only its own tail.
            self._free_pin(old)
            self._expired.discard(job_id)
            self.pin_stats["replaced"] += 1
        else:
            self.waiting.set_job_pinned(job_id, True)  # type: ignore[attr-defined]

    def _release_latest_pin(self, own_job: str | None, reason: str) -> bool:
        """Releases the pin of the latest-arriving job other than ``own_job`` (``own_job``'s only if it is the last
        pin); False when nothing is pinned."""
        if not self._pins:
            return False
        candidates = [pin for job, pin in self._pins.items() if job != own_job] or list(self._pins.values())
        victim = max(candidates, key=lambda pin: (pin.job_arrival, pin.seq))
        self._release_pin(victim.job_id, reason)
        return True

    def _release_pin(self, job_id: str, reason: str) -> None:
        pin = self._pins.pop(job_id)
        self._free_pin(pin)
        self._expired.discard(job_id)
        self.waiting.set_job_pinned(job_id, False)  # type: ignore[attr-defined]
        self.pin_stats[reason] += 1

    def _free_pin(self, pin: Pin) -> None:
        del self._pin_by_request_id[pin.request.request_id]
        self.kv_cache_manager.free(pin.request)

    def _evict_idle_jobs(self, now: float, over_cap: bool = False) -> None:
        """Forgets jobs idle past the timeout (or the oldest idle ones while over ``max_jobs``); looks at a few
        of the least recently active jobs per call, so the cost per step stays constant."""
        jobs = self._jobs
        for _ in range(8):
            if not jobs:
                return
            job_id, state = next(iter(jobs.items()))
            idle = state.live == 0 and job_id not in self._pins
            expired = now - state.last_seen > self.job_idle_timeout_s
            if idle and (expired or (over_cap and len(jobs) > self.max_jobs)):
                del jobs[job_id]
                if self._forget_estimator_job is not None:
                    self._forget_estimator_job(job_id)
            elif not idle and (expired or over_cap):
                jobs.move_to_end(job_id)  # busy: look at it again later
            else:
                return

    def _parse_tool(self, request: Request) -> str | None:
        if self.tool_parser is None:
            return None
        detokenize = self._detokenize or self._load_detokenizer()
        if detokenize is None:
            return None
        try:
            return self.tool_parser.parse(detokenize(list(request.output_token_ids)))
        except Exception:  # a parser bug must not take the engine down: the tool is then unknown
            logger.exception("Continuum: tool-call parsing failed for request %s", request.request_id)
            return None

    def _load_detokenizer(self) -> Detokenize | None:
        path, self._tokenizer_path = self._tokenizer_path, None  # one attempt
        if path is None:
            return None
        try:
            from vllite.engine.tokenizer import get_tokenizer

            tokenizer = get_tokenizer(path)
        except Exception as exc:
            logger.warning("Continuum: no tokenizer for tool-call parsing (%s); tools are unknown", exc)
            return None
        self._detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        return self._detokenize


def _build_estimator(config: EngineConfig) -> Any:
    from vllite.plugin_manager import resolve_component

    return resolve_component("tool_call_estimators", config.scheduler_config.tool_call_estimator)(config)
