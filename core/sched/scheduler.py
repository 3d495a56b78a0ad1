"""``Scheduler``: vLLM V1's token-budget algorithm, with the policy-specific choices as small methods.

There is no prefill phase and no decode phase: every request has ``num_computed_tokens`` and
``num_tokens_with_spec``, and each step closes as much of the gap as one shared token budget allows. Running
requests are served first, in admission order; then waiting requests are admitted while budget, batch width
and KV blocks last. When a running request cannot get KV blocks, the policy may first release blocks it holds
outside the requests (``on_running_allocation_failed``); otherwise a victim is preempted by recompute.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllite.kv_cache import KVCacheBlocks, KVCacheManager, get_hash_fn, get_request_block_hasher
from vllite.protocol import EngineCoreEventType
from vllite.request import Request, RequestStatus
from vllite.sched.cached_data import make_cached_request_data
from vllite.sched.interface import PauseState, SchedulerInterface
from vllite.sched.output import NewRequestData, SchedulerOutput
from vllite.sched.request_queue import FCFSRequestQueue, RequestQueue
from vllite.sched.updates import OutputUpdateMixin

if TYPE_CHECKING:
    from vllite.config import EngineConfig

StepObserver = Callable[..., Any]
_FROM_PLUGINS: Any = object()


class Scheduler(OutputUpdateMixin, SchedulerInterface):
    """The token-budget scheduler (vLLM V1's algorithm); FCFS unless a subclass overrides a policy decision.

    Policy decisions, each a small method a plugin overrides without touching ``schedule()``:

    - :meth:`create_waiting_queue` — the waiting queue, hence the admission order (FCFS deque here).
    - :meth:`select_preemption_victim` — which running request to preempt when one needs KV blocks (the last
      admitted here). Any running request may be returned, including one already scheduled this step: the
      algorithm refunds its tokens and blocks, so the choice never corrupts the step.
    - :meth:`on_request_finished` — free the blocks of a finished request, or keep them (e.g. pinned for a
      TTL); returns whether they were freed. A kept request is gone from the scheduler; its blocks are the
      policy's to release (``self.kv_cache_manager.free(request)``).
    - :meth:`on_step_start` — housekeeping at the top of every ``schedule()`` (e.g. releasing expired pins),
      before any allocation decision.
    - :meth:`on_request_arrival` — bookkeeping when a request arrives, before it is queued.
    - :meth:`on_request_admitted` — bookkeeping when a waiting request is admitted to running.
    - :meth:`on_admission_blocked` — the head of the waiting queue cannot get KV blocks: release blocks held
      outside the scheduler's requests (e.g. pins) and retry, or stop admitting for this step.
    - :meth:`on_running_allocation_failed` — a running request cannot get KV blocks: release blocks held outside
      the scheduler's requests (e.g. pins) and retry, or fall through to preempting a running request.

    Contract with the executor (``vllite.sched.output``): first-time requests and requests resumed after a
    preemption come as ``NewRequestData`` (resumed ones carry their output tokens; the workers dropped them on
    the step whose ``preempted_req_ids`` named them; workers apply ``finished_req_ids`` and
    ``preempted_req_ids`` before adding new requests). Requests already running come as ``CachedRequestData``:
    ``new_block_ids[i]`` (``None`` = no new blocks), ``num_computed_tokens[i]`` (before this step),
    ``new_token_ids[i]`` (the non-draft tokens scheduled now), ``all_token_ids`` only for requests that were not
    scheduled in the previous step. Drafts are in ``scheduled_spec_decode_tokens``.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        *,
        log_stats: bool = False,
        clock: Callable[[], float] = time.monotonic,
        step_observer: StepObserver | None = _FROM_PLUGINS,
    ) -> None:
        sched = config.scheduler_config
        cache = config.cache_config
        self.config = config
        self.scheduler_config = sched
        self.cache_config = cache
        self.log_stats = log_stats
        self.clock = clock
        self.max_model_len = sched.max_model_len or config.model_config.max_model_len or 0
        if self.max_model_len <= 0 or sched.max_num_batched_tokens is None:
            raise ValueError("The scheduler needs max_model_len: call config.set_max_model_len(n) first.")
        self.max_num_running_reqs = sched.max_num_seqs
        self.max_num_scheduled_tokens = sched.max_num_batched_tokens
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.long_prefill_token_threshold = sched.long_prefill_token_threshold
        self.num_lookahead_tokens = sched.num_lookahead_tokens
        self.block_size = cache.block_size
        self.enable_caching = cache.enable_prefix_caching
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, self.max_model_len, enable_caching=self.enable_caching, log_stats=log_stats
        )
        self.block_hasher = (
            get_request_block_hasher(self.block_size, get_hash_fn(cache.prefix_caching_hash_algo))
            if self.enable_caching
            else None
        )
        self.connector = None

        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = self.create_waiting_queue()
        self.running: list[Request] = []
        # Reassigned (never cleared) each step: the previous SchedulerOutput still holds the old set.
        self.finished_req_ids: set[str] = set()
        self.finished_req_ids_dict: dict[int, set[str]] = defaultdict(set)
        self.prev_step_scheduled_req_ids: set[str] = set()
        # Preempted outside schedule() (reset_prefix_cache): reported in the next SchedulerOutput.
        self._preempted_between_steps: set[str] = set()
        self._pause_state = PauseState.UNPAUSED
        self.step_counter = 0
        self._num_preemptions_since_stats = 0
        self.num_preemptions_total = 0  # cumulative, for tests and benchmarks
        if step_observer is _FROM_PLUGINS:
            from vllite.plugin_manager import get_hook_caller

            step_observer = get_hook_caller("vllite_step_observer")
        self.step_observer: StepObserver | None = step_observer

    # ------------------------------------------------------------------ policy decisions
    def create_waiting_queue(self) -> RequestQueue:
        """Builds the waiting queue; its order is the admission order. Called once, in ``__init__``.

        Promise: preempted requests come back through ``prepend_request``. Default: FCFS (a deque, preempted
        requests at the head).
        """
        return FCFSRequestQueue()

    def select_preemption_victim(self, running: Sequence[Request], request: Request) -> Request:
        """Chooses the request to preempt so that ``request`` (at some index of ``running``) can get KV blocks.

        May return ``request`` itself, which then gives up this step. Must return a member of ``running`` and
        must not modify it. Default (FCFS): the last admitted request, ``running[-1]``.
        """
        return running[-1]

    def on_request_finished(self, request: Request) -> bool:
        """Releases (or keeps) the KV blocks of a request that just finished (stopped, capped or aborted).

        Returns True when the blocks were freed. Default: free them at once.
        """
        self.kv_cache_manager.free(request)
        return True

    def on_step_start(self) -> None:
        """Per-step housekeeping at the top of ``schedule()``, before any allocation. Default: nothing."""

    def on_request_arrival(self, request: Request) -> None:
        """Bookkeeping for a newly arrived request, before it is queued. Default: nothing."""

    def on_request_admitted(self, request: Request) -> None:
        """Bookkeeping for a waiting request (new or preempted) just admitted to running: its blocks, prefix-cache
        hits included, are allocated and it has left the waiting queue. Default: nothing."""

    def on_admission_blocked(self, request: Request) -> bool:
        """The head of the waiting queue, ``request``, cannot get KV blocks (and nothing was preempted this step).

        Return True after releasing something (e.g. one pinned request's blocks): the algorithm then looks at the
        head of the queue again and retries. Return False when there is nothing to release: admission stops for
        this step. Each True must release something, or the step never ends. Default: False.
        """
        return False

    def on_running_allocation_failed(self, request: Request) -> bool:
        """The running request ``request`` cannot get KV blocks for this step, before a victim is chosen.

        Return True after releasing blocks held outside the scheduler's requests (e.g. one pinned request's
        blocks): the algorithm then retries the allocation, and preempts nothing if it now succeeds. Return False
        when there is nothing to release: a victim is then chosen by :meth:`select_preemption_victim`. Called
        again before every further victim while the allocation keeps failing. Must not touch ``self.running``,
        the waiting queue's requests, or any request the scheduler holds; each True must release something, or
        the step never ends. Default: False (preempt at once).
        """
        return False

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        """Registers a request and queues it as WAITING; ``ValueError`` for a duplicate id, an empty prompt, or a
        prompt longer than ``max_model_len``."""
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in the scheduler.")
        if request.num_tokens == 0:
            raise ValueError(f"Request {request.request_id!r} has an empty prompt.")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"Request {request.request_id!r} has {request.num_tokens} tokens, more than max_model_len "
                f"({self.max_model_len})."
            )
        self.requests[request.request_id] = request
        self.on_request_arrival(request)
        self.waiting.add_request(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED, self.clock())

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> list[Request]:
        """Finishes requests in any state (``None`` = every request) with ``finished_status``.

        Unknown and already-finished ids are ignored, so aborting twice is harmless. Finished ids are reported
        to the workers in the next ``SchedulerOutput`` and to the clients in the next outputs.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finish_requests needs a finished status, got {finished_status!r}.")
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: list[Request] = []
        from_running: set[Request] = set()
        from_waiting: list[Request] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                from_running.add(request)
            else:
                from_waiting.append(request)
            request.status = finished_status
            self._free_request(request)
            finished.append(request)
        if from_running:
            self.running[:] = [r for r in self.running if r not in from_running]
        if from_waiting:
            self.waiting.remove_requests(from_waiting)
        return finished

    def _free_request(self, request: Request) -> None:
        """Forgets a finished request (already out of the queues) and lets the policy free its blocks."""
        request_id = request.request_id
        self.finished_req_ids.add(request_id)
        self.finished_req_ids_dict[request.client_index].add(request_id)
        self._preempted_between_steps.discard(request_id)
        del self.requests[request_id]
        self.on_request_finished(request)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Builds this step's batch (see the module docstring) and advances ``num_computed_tokens``."""
        self.on_step_start()
        self.step_counter += 1
        kv = self.kv_cache_manager
        kv.new_step_starts()
        now = self.clock()
        initial_budget = 0 if self._pause_state == PauseState.PAUSED_ALL else self.max_num_scheduled_tokens
        token_budget = initial_budget
        threshold = self.long_prefill_token_threshold
        lookahead = self.num_lookahead_tokens
        tracing = self.step_observer is not None
        running = self.running

        num_scheduled_tokens: dict[str, int] = {}
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        spec_tokens: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        preempted: list[Request] = []
        lost_tokens: dict[str, int] = {}
        prefix_hits: dict[str, int] = {}

        # Running requests first, in admission order.
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_new = request.num_tokens_with_spec - request.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            # Never schedule a position at or past max_model_len.
            num_new = min(num_new, token_budget, self.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                req_index += 1
                continue
            while True:
                # Caching is deferred: a victim refunded below must not leave never-computed blocks cached.
                new_blocks = kv.allocate_slots(
                    request, num_new, num_lookahead_tokens=lookahead, delay_cache_blocks=True
                )
                if new_blocks is not None:
                    break
                if self.on_running_allocation_failed(request):
                    continue  # the policy released blocks outside the scheduler's requests: retry
                victim = self.select_preemption_victim(running, request)
                victim_index = next(i for i, r in enumerate(running) if r is victim)
                del running[victim_index]
                if victim_index < req_index:
                    req_index -= 1
                victim_id = victim.request_id
                refund = num_scheduled_tokens.pop(victim_id, None)
                if refund is not None:
                    token_budget += refund
                    del req_to_new_blocks[victim_id]
                    spec_tokens.pop(victim_id, None)
                    scheduled_running.remove(victim)
                if tracing:
                    lost_tokens[victim_id] = victim.num_computed_tokens
                self._preempt_request(victim, now)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                continue  # preempted itself; the next request now sits at req_index
            request_id = request.request_id
            scheduled_running.append(request)
            req_to_new_blocks[request_id] = new_blocks
            num_scheduled_tokens[request_id] = num_new
            token_budget -= num_new
            req_index += 1
            if request.spec_token_ids:
                num_spec = num_new + request.num_computed_tokens - request.num_tokens
                if num_spec > 0:
                    spec_tokens[request_id] = request.spec_token_ids[:num_spec]
                request.spec_token_ids = []
        if self.enable_caching:
            for request in scheduled_running:
                end = request.num_computed_tokens + num_scheduled_tokens[request.request_id]
                kv.cache_blocks(request, end)

        # Then waiting requests, unless this step preempted (admitting now would just thrash) or paused.
        if not preempted and self._pause_state == PauseState.UNPAUSED:
            waiting = self.waiting
            while waiting and token_budget > 0 and len(running) < self.max_num_running_reqs:
                request = waiting.peek_request()
                if request.num_computed_tokens == 0:
                    hit_blocks, num_hit = kv.get_computed_blocks(request)
                else:
                    hit_blocks, num_hit = kv.empty_kv_cache_blocks, 0
                num_computed = request.num_computed_tokens + num_hit
                num_new = request.num_tokens - num_computed
                if self.enable_chunked_prefill:
                    if 0 < threshold < num_new:
                        num_new = threshold
                    num_new = min(num_new, token_budget)
                elif num_new > token_budget:
                    break  # whole prompt or nothing
                new_blocks = kv.allocate_slots(request, num_new, num_hit, hit_blocks, num_lookahead_tokens=lookahead)
                if new_blocks is None:
                    if self.on_admission_blocked(request):
                        continue  # the policy released blocks: look at the (possibly new) head again
                    break  # out of blocks: no preemption to admit
                waiting.pop_request()
                running.append(request)
                request_id = request.request_id
                if request.status == RequestStatus.PREEMPTED:
                    scheduled_resumed.append(request)
                else:
                    scheduled_new.append(request)
                if self.log_stats:
                    request.record_event(EngineCoreEventType.SCHEDULED, now)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_computed
                num_scheduled_tokens[request_id] = num_new
                token_budget -= num_new
                if tracing:
                    prefix_hits[request_id] = num_hit
                self.on_request_admitted(request)

        total = initial_budget - token_budget
        assert 0 <= total <= self.max_num_scheduled_tokens, (total, self.max_num_scheduled_tokens)
        assert len(running) <= self.max_num_running_reqs

        preempted_ids = {r.request_id for r in preempted}
        if self._preempted_between_steps:
            preempted_ids |= self._preempted_between_steps
            self._preempted_between_steps = set()
        admitted = scheduled_new + scheduled_resumed
        output = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(r, kv.get_block_ids(r.request_id)) for r in admitted],
            scheduled_cached_reqs=make_cached_request_data(
                scheduled_running,
                num_scheduled_tokens,
                spec_tokens,
                req_to_new_blocks,
                self.prev_step_scheduled_req_ids,
            ),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted_ids,
        )
        self.prev_step_scheduled_req_ids = set(num_scheduled_tokens)
        # After the output is built (it keeps the pre-step counts), before the model runs.
        for request in scheduled_running:
            request.num_computed_tokens += num_scheduled_tokens[request.request_id]
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
        for request in admitted:
            request.num_computed_tokens += num_scheduled_tokens[request.request_id]
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
        self.finished_req_ids = set()

        if tracing:
            self._observe_step(
                now, output, scheduled_new, scheduled_resumed, scheduled_running, lost_tokens, prefix_hits
            )
        return output

    def _preempt_request(self, request: Request, timestamp: float) -> None:
        """Preemption by recompute: frees the blocks, resets progress, puts the request back in waiting."""
        assert request.status == RequestStatus.RUNNING, request
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.is_prefill_chunk = False
        if request.spec_token_ids:
            request.spec_token_ids = []
        request.num_preemptions += 1
        self._num_preemptions_since_stats += 1
        self.num_preemptions_total += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
        self.waiting.prepend_request(request)

    def _observe_step(
        self,
        now: float,
        output: SchedulerOutput,
        new: list[Request],
        resumed: list[Request],
        running: list[Request],
        lost_tokens: dict[str, int],
        prefix_hits: dict[str, int],
    ) -> None:
        """Builds the step record and hands it to the observer hook (only called when one is present)."""
        kv = self.kv_cache_manager
        counts = output.num_scheduled_tokens
        assert self.step_observer is not None
        self.step_observer(
            step={
                "step": self.step_counter,
                "time": now,
                "scheduler": type(self).__name__,
                "num_waiting": len(self.waiting),
                "num_running": len(self.running),
                "free_blocks": kv.num_free_blocks,
                "cached_blocks": kv.num_cached_blocks,
                "kv_cache_usage": kv.usage,
                "token_budget": self.max_num_scheduled_tokens,
                "total_scheduled_tokens": output.total_num_scheduled_tokens,
                "new": {r.request_id: counts[r.request_id] for r in new},
                "resumed": {r.request_id: counts[r.request_id] for r in resumed},
                "running": {r.request_id: counts[r.request_id] for r in running},
                "preempted": lost_tokens,
                "prefix_hits": prefix_hits,
                "spec_tokens": {k: len(v) for k, v in output.scheduled_spec_decode_tokens.items()},
            }
        )
