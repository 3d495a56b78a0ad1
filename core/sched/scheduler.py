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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from vllite.exceptions import KVCacheStateError
from vllite.kv_cache import KVCacheManager, get_hash_fn, get_request_block_hasher
from vllite.kv_connector.scheduler_side import KVTransfer, make_kv_transfer
from vllite.protocol import EngineCoreEventType, EngineCoreOutputs, SchedulerStats
from vllite.request import Request, RequestStatus
from vllite.sched import lifecycle
from vllite.sched.cached_data import make_cached_request_data
from vllite.sched.faults import fail_request, release_finished, step_start
from vllite.sched.interface import PauseState, SchedulerInterface
from vllite.sched.output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from vllite.sched.phases import admit_waiting, schedule_running
from vllite.sched.policy_args import check_policy_args
from vllite.sched.request_queue import FCFSRequestQueue, RequestQueue
from vllite.sched.sessions import SessionHolds, add_chunk, release_all, release_expired
from vllite.sched.spec_decode import SpecDecodingTracker
from vllite.sched.step_state import StepState, make_step_record
from vllite.sched.updates import update_from_output
from vllite.structured_output.manager import filter_drafts

if TYPE_CHECKING:
    from vllite.config import EngineConfig

StepObserver = Callable[..., Any]
_FROM_PLUGINS: Any = object()


class Scheduler(SchedulerInterface):
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
    - :meth:`admission_num_tokens` / :meth:`admission_reserved_blocks` — the admission gates: how much of a
      waiting request must fit in free KV blocks (vLLM's ``scheduler_reserve_full_isl``) and how many blocks must
      stay free after it (vLLM's ``watermark``).
    - :meth:`on_admission_blocked` — the head of the waiting queue cannot get KV blocks: release blocks held
      outside the scheduler's requests (e.g. pins) and retry, or stop admitting for this step.
    - :meth:`on_running_allocation_failed` — a running request cannot get KV blocks: release blocks held outside
      the scheduler's requests (e.g. pins) and retry, or fall through to preempting a running request.
    - :meth:`session_hold_seconds` — how long a session parked between turns keeps its KV blocks.
    - :meth:`on_session_resumed` — bookkeeping when a session's next input chunk starts its next turn.

    Sessions (resumable requests, ``vllite.sched.sessions``) are the algorithm's: a parked session's held blocks
    are released before any of the memory hooks above is asked.

    Contract with the executor (``vllite.sched.output``): first-time requests and requests resumed after a
    preemption come as ``NewRequestData`` (resumed ones carry their output tokens; the workers dropped them on
    the step whose ``preempted_req_ids`` named them; workers apply ``finished_req_ids`` and
    ``preempted_req_ids`` before adding new requests). Requests already running come as ``CachedRequestData``:
    ``new_block_ids[i]`` (``None`` = no new blocks), ``num_computed_tokens[i]`` (before this step),
    ``new_token_ids[i]`` (the non-draft tokens scheduled now), ``all_token_ids`` only for requests that were not
    scheduled in the previous step. Drafts are in ``scheduled_spec_decode_tokens``.
    """

    #: The ``scheduler_config.policy_args`` keys this policy reads, each with a one-line description (and its
    #: default). A subclass extends its parent's: ``{**Parent.accepted_policy_args, "key": "..."}``. Any other key
    #: is a ``ValueError`` at construction.
    accepted_policy_args: ClassVar[Mapping[str, str]] = {
        "session_idle_timeout_s": "how long a session parked between turns keeps its KV blocks, in seconds (60)",
    }

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        *,
        log_stats: bool = False,
        clock: Callable[[], float] = time.monotonic,
        step_observer: StepObserver | None = _FROM_PLUGINS,
        sliding_window: int | None = None,
        kv_cache_groups: Sequence[int | None] = (),
    ) -> None:
        self.config = config
        self.scheduler_config = config.scheduler_config
        self.cache_config = config.cache_config
        self.log_stats = log_stats
        self.clock = clock
        self._init_limits(config)
        self.sliding_window = sliding_window
        self.kv_cache_groups = tuple(kv_cache_groups)
        self.kv_cache_manager = self._make_kv_cache_manager(num_blocks, sliding_window, self.kv_cache_groups)
        self.watermark_blocks = int(config.scheduler_config.watermark * num_blocks)
        self.block_hasher = (
            get_request_block_hasher(self.block_size, get_hash_fn(self.cache_config.prefix_caching_hash_algo))
            if self.enable_caching
            else None
        )
        # The KV connector's scheduler side (vllite.plugins.kv_connectors.scheduling); None without a connector.
        self.kv_transfer: KVTransfer | None = make_kv_transfer(self)
        self.connector = self.kv_transfer.connector if self.kv_transfer is not None else None
        self._init_request_state()
        # Drafts verified and accepted (vllite.sched.spec_decode); None without --speculative-config.
        self.spec_decoding = SpecDecodingTracker.from_config(config, log_stats)
        if step_observer is _FROM_PLUGINS:
            from vllite.plugin_manager import get_hook_caller

            step_observer = get_hook_caller("vllite_step_observer")
        self.step_observer: StepObserver | None = step_observer

    def _init_limits(self, config: EngineConfig) -> None:
        """Copies the limits and switches the algorithm reads every step out of the config, after checking that
        the engine settled the context length and the token budget and that every policy arg is accepted."""
        sched, cache = config.scheduler_config, config.cache_config
        self.max_model_len = config.model_config.max_model_len or 0
        if self.max_model_len <= 0 or sched.max_num_batched_tokens is None:
            raise ValueError(
                "The scheduler needs a config with a concrete model_config.max_model_len and "
                "scheduler_config.max_num_batched_tokens (the limits the engine settled on)."
            )
        check_policy_args(type(self).__name__, sched.policy_args, self.accepted_policy_args)
        self.max_num_running_reqs = sched.max_num_seqs
        self.max_num_scheduled_tokens = sched.max_num_batched_tokens
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.long_prefill_token_threshold = sched.long_prefill_token_threshold
        self.scheduler_reserve_full_isl = sched.scheduler_reserve_full_isl
        self.num_lookahead_tokens = sched.num_lookahead_tokens
        self.block_size = cache.block_size
        self.enable_caching = cache.enable_prefix_caching
        self.session_idle_timeout_s = float(sched.policy_args.get("session_idle_timeout_s", 60.0))
        # Distinct LoRA adapters one step may run (None: LoRA off); see phases.admit_waiting.
        self.max_loras = config.lora_config.max_loras if config.lora_config is not None else None

    def _init_request_state(self) -> None:
        """Starts with no request: the waiting queue (:meth:`create_waiting_queue`), the running list, the ids
        to report, the failures to deliver, the pause state and the step and preemption counters."""
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = self.create_waiting_queue()
        self.running: list[Request] = []
        # Reassigned (never cleared) each step: the previous SchedulerOutput still holds the old set.
        self.finished_req_ids: set[str] = set()
        self.finished_req_ids_dict: dict[int, set[str]] = defaultdict(set)
        self.prev_step_scheduled_req_ids: set[str] = set()
        # Preempted outside schedule() (reset_prefix_cache): reported in the next SchedulerOutput.
        self._preempted_between_steps: set[str] = set()
        self.failed_requests: list[Request] = []  # see vllite.sched.faults
        # Sessions (vllite.sched.sessions): parked ones holding blocks, and those whose input ended while parked.
        self.session_holds = SessionHolds()
        self.closed_sessions: list[Request] = []
        self.fail_after_step: dict[str, str] = {}
        self._pause_state = PauseState.UNPAUSED
        self.step_counter = 0
        self._num_preemptions_since_stats = 0
        self.num_preemptions_total = 0  # cumulative, for tests and benchmarks

    def _make_kv_cache_manager(
        self, num_blocks: int, sliding_window: int | None, kv_cache_groups: Sequence[int | None] = ()
    ) -> KVCacheManager:
        # With a window shared by every attention layer, blocks that fall out of it return to the pool; with
        # several KV-cache groups (windows per group of layers), each group frees what leaves its own window.
        return KVCacheManager(
            num_blocks,
            self.block_size,
            self.max_model_len,
            enable_caching=self.enable_caching,
            log_stats=self.log_stats,
            sliding_window=sliding_window,
            kv_cache_groups=kv_cache_groups,
        )

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

    def session_hold_seconds(self, request: Request) -> float:
        """How long the session ``request``, parked after a turn, keeps its KV blocks (0: release them at once).

        Held blocks are also released earlier when another request needs blocks. Default: ``policy_args
        session_idle_timeout_s`` (60 s).
        """
        return self.session_idle_timeout_s

    def on_session_resumed(self, request: Request) -> None:
        """Bookkeeping when a session's next input chunk starts its next turn (``request`` is queued, WAITING, with
        the chunk's tokens appended and its sampling parameters). Default: nothing."""

    def admission_num_tokens(self, request: Request, num_tokens: int) -> int:
        """How many tokens of the waiting ``request`` need KV blocks for it to be admitted now, when this step would
        compute it up to ``num_tokens`` tokens (its first prefill chunk).

        Default: its whole current sequence (the prompt, plus the outputs of a preempted request) with
        ``scheduler_reserve_full_isl`` (vLLM's default), so a prompt is not admitted only to be preempted a chunk
        later; ``num_tokens`` (eager, chunk by chunk) without it.
        """
        return max(num_tokens, request.num_tokens) if self.scheduler_reserve_full_isl else num_tokens

    def admission_reserved_blocks(self, request: Request) -> int:
        """KV blocks that must stay free after the waiting ``request`` is admitted. Default: vLLM's ``watermark``
        (that fraction of all blocks) while any request runs, else 0 (a lone request may use the whole cache)."""
        return self.watermark_blocks if self.running else 0

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
        prompt longer than ``max_model_len`` (``vllite.sched.lifecycle``)."""
        lifecycle.add_request(self, request)

    def add_session_chunk(self, chunk: Request) -> None:
        """The next input chunk (or the end of the input) of the live session ``chunk.request_id``; see
        ``vllite.sched.sessions``. ``SessionClosedError`` when no such session is open."""
        add_chunk(self, chunk)

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> list[Request]:
        """Finishes requests in any state (``None`` = every request) with ``finished_status``.

        Unknown and already-finished ids are ignored, so aborting twice is harmless. Finished ids are reported
        to the workers in the next ``SchedulerOutput`` and to the clients in the next outputs.
        """
        return lifecycle.finish_requests(self, request_ids, finished_status)

    def _free_request(self, request: Request) -> None:
        """Forgets a finished request (already out of the queues) and lets the policy free its blocks."""
        request_id = request.request_id
        self.finished_req_ids.add(request_id)
        self.finished_req_ids_dict[request.client_index].add(request_id)
        self._preempted_between_steps.discard(request_id)
        self.fail_after_step.pop(request_id, None)
        self.session_holds.discard(request_id)
        del self.requests[request_id]
        if self.kv_transfer is not None and self.kv_transfer.hold_finished(self, request):
            return  # its blocks go to the policy once the connector reports its transfers done
        release_finished(self, request)

    def fail_request(self, request: Request, error: str) -> None:
        """Finishes ``request`` (already out of the running list and the waiting queue) with ERROR and frees its
        blocks; its finish output, carrying ``error``, goes out with the next ``update_from_output``."""
        fail_request(self, request, error)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Builds this step's batch (see the module docstring) and advances ``num_computed_tokens``."""
        step_start(self)
        if self.session_holds:
            release_expired(self)
        self.step_counter += 1
        self.kv_cache_manager.new_step_starts()
        budget = 0 if self._pause_state == PauseState.PAUSED_ALL else self.max_num_scheduled_tokens
        step = StepState(now=self.clock(), initial_budget=budget, tracing=self.step_observer is not None)
        schedule_running(self, step)
        # Admitting right after a preemption would just thrash.
        if not step.preempted and self._pause_state == PauseState.UNPAUSED:
            admit_waiting(self, step)
        assert 0 <= step.total_scheduled_tokens <= self.max_num_scheduled_tokens, step.total_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs

        output = self._make_output(step)
        if self.kv_transfer is not None:
            self.kv_transfer.build_meta(output)
        self.prev_step_scheduled_req_ids = set(step.num_scheduled_tokens)
        # After the output is built (it keeps the pre-step counts), before the model runs.
        for request in (*step.running, *step.new, *step.resumed):
            request.num_computed_tokens += step.num_scheduled_tokens[request.request_id]
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
        self.finished_req_ids = set()
        if self.step_observer is not None:
            self.step_observer(step=make_step_record(self, step, output))
        return output

    def _make_output(self, step: StepState) -> SchedulerOutput:
        """The executor's view of the step, with the pre-step ``num_computed_tokens``."""
        preempted_ids = {r.request_id for r in step.preempted}
        if self._preempted_between_steps:
            preempted_ids |= self._preempted_between_steps
            self._preempted_between_steps = set()
        get_block_ids = self.kv_cache_manager.get_block_ids
        return SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(r, get_block_ids(r.request_id)) for r in step.admitted],
            scheduled_cached_reqs=make_cached_request_data(step, self.prev_step_scheduled_req_ids),
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=step.total_scheduled_tokens,
            scheduled_spec_decode_tokens=step.spec_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted_ids,
        )

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

    # ------------------------------------------------------------------ outputs
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Applies one step's sampled tokens and returns the outputs per client index.

        For each scheduled request still alive: rejected draft tokens are rolled back from
        ``num_computed_tokens`` (D drafts, G sampled tokens → D - (G - 1) rejected); sampled tokens are appended
        one at a time with a stop check after each (tokens after a stop are dropped); a finished request leaves
        the running list (or the waiting list, if it was preempted meanwhile) and its blocks go to
        ``on_request_finished``. Prefill chunks that sample nothing produce no output. Finished ids since the
        previous call are reported per client in ``finished_requests``; stats ride on one client's outputs.
        """
        return update_from_output(self, scheduler_output, model_runner_output)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Attaches the drafter's proposals to running requests that finished their prefill (others ignored);
        they are scheduled, within the budget, in the next step and verified by its output."""
        requests = self.requests
        for request_id, token_ids in draft_token_ids.items():
            request = requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING or request.is_prefill_chunk:
                continue
            if request.structured_output_request is not None:
                token_ids = filter_drafts(request, list(token_ids))  # cut at the first token the grammar refuses
            request.spec_token_ids = list(token_ids)

    # ------------------------------------------------------------------ queries
    def get_num_unfinished_requests(self) -> int:
        """Waiting + running; only running under ``PAUSED_NEW``; 0 under ``PAUSED_ALL`` (so the engine idles)."""
        if self._pause_state == PauseState.PAUSED_ALL:
            return 0
        if self._pause_state == PauseState.PAUSED_NEW:
            return len(self.running)
        return len(self.waiting) + len(self.running)

    def has_finished_requests(self) -> bool:
        """Whether finished ids are still to be reported to the workers or the clients, or finished requests'
        blocks still wait for the KV connector (the engine keeps stepping so that the worker can report it)."""
        if self.kv_transfer is not None and self.kv_transfer.held:
            return True
        return bool(self.finished_req_ids) or any(self.finished_req_ids_dict.values())

    def get_request_counts(self) -> tuple[int, int]:
        """``(num_running, num_waiting)``."""
        return len(self.running), len(self.waiting)

    def get_kv_cache_usage(self) -> float:
        """The fraction of KV blocks in use."""
        return self.kv_cache_manager.usage

    @property
    def pause_state(self) -> PauseState:
        """The current pause state (see :class:`vllite.sched.PauseState`)."""
        return self._pause_state

    def set_pause_state(self, pause_state: PauseState) -> None:
        """Sets the pause state; the next ``schedule()`` honours it."""
        self._pause_state = PauseState(pause_state)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached block hash. Fails (False) while requests hold blocks, unless
        ``reset_running_requests``: then every running request is preempted first (reported in the next
        ``SchedulerOutput.preempted_req_ids``) and a failure raises ``KVCacheStateError``."""
        release_all(self)  # a parked session's next turn recomputes
        if reset_running_requests:
            now = self.clock()
            while self.running:
                request = self.running.pop()
                self._preempt_request(request, now)
                self._preempted_between_steps.add(request.request_id)
            self.prev_step_scheduled_req_ids = set()
        # With a KV connector, blocks are also held outside running requests (parked loads, delayed frees): a
        # forced reset drops their hashes too.
        force = reset_running_requests and self.kv_transfer is not None
        ok = self.kv_cache_manager.reset_prefix_cache(force)
        if reset_running_requests and not ok:
            raise KVCacheStateError("Could not reset the prefix cache although every running request was preempted.")
        return ok

    def make_stats(self) -> SchedulerStats | None:
        """Running / waiting counts, KV usage, prefix-cache (and KV connector) queries and hits and preemptions since
        the previous call; ``None`` unless stats are on."""
        if not self.log_stats:
            return None
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        external = self.kv_transfer.take_lookup_stats() if self.kv_transfer is not None else None
        num_preemptions, self._num_preemptions_since_stats = self._num_preemptions_since_stats, 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries if prefix else 0,
            prefix_cache_hits=prefix.hits if prefix else 0,
            num_preemptions=num_preemptions,
            step_counter=self.step_counter,
            spec_decoding_stats=self.spec_decoding.take_stats() if self.spec_decoding is not None else None,
            num_skipped_waiting_reqs=sum(1 for r in self.waiting if RequestStatus.is_blocked_waiting(r.status)),
            external_prefix_cache_queries=external.queries if external else 0,
            external_prefix_cache_hits=external.hits if external else 0,
        )

    def shutdown(self) -> None:
        """Shuts the KV connector's scheduler side down (if any); plugins that open files extend it."""
        if self.kv_transfer is not None:
            self.kv_transfer.shutdown()

    def iter_requests(self) -> Iterable[Request]:
        """Every live request (waiting, preempted or running)."""
        return self.requests.values()
