"""One step's two scheduling phases, as plain functions behind ``Scheduler.schedule``: serving the running
requests (preempting when one cannot get KV blocks) and admitting waiting ones. Every policy decision stays a
method of the scheduler (``select_preemption_victim``, ``on_running_allocation_failed``, ``on_admission_blocked``,
``on_request_admitted``); these functions only call them.

Fault isolation: a policy method that raises is pinned to the request it was deciding about. A request that
could not get blocks (``on_running_allocation_failed``, ``select_preemption_victim`` or ``on_admission_blocked``
raised) leaves the step at once with ERROR and its blocks freed; nothing was allocated for it this step. A request
already admitted when ``on_request_admitted`` raised stays in this step's batch (its blocks are allocated, maybe
cached, so its KV must be computed) and is failed once the step's output is in. A request that can never fit the KV
cache (it needs more blocks than the whole cache has) ends with ERROR instead of being preempted and recomputed
forever.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllite.exceptions import PluginHookError
from vllite.protocol import EngineCoreEventType
from vllite.request import Request, RequestStatus
from vllite.sched.faults import never_fits, never_fits_message

if TYPE_CHECKING:
    from vllite.kv_cache import KVCacheBlocks
    from vllite.sched.scheduler import Scheduler
    from vllite.sched.step_state import StepState


def schedule_running(scheduler: Scheduler, step: StepState) -> None:
    """Serves running requests in admission order, preempting when one cannot get blocks."""
    running = scheduler.running
    req_index = 0
    while req_index < len(running) and step.token_budget > 0:
        request = running[req_index]
        num_new = request.num_tokens_with_spec - request.num_computed_tokens
        if 0 < scheduler.long_prefill_token_threshold < num_new:
            num_new = scheduler.long_prefill_token_threshold
        # Never schedule a position at or past max_model_len.
        num_new = min(num_new, step.token_budget, scheduler.max_model_len - request.num_computed_tokens)
        if num_new <= 0:
            req_index += 1
            continue
        new_blocks, req_index = allocate_or_preempt(scheduler, request, num_new, req_index, step)
        if new_blocks is None:
            continue  # preempted itself; the next request now sits at req_index
        step.schedule_running(request, num_new, new_blocks)
        req_index += 1
        if request.spec_token_ids:
            num_spec = num_new + request.num_computed_tokens - request.num_tokens
            if num_spec > 0:
                step.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []
    if scheduler.enable_caching:
        for request in step.running:
            end = request.num_computed_tokens + step.num_scheduled_tokens[request.request_id]
            scheduler.kv_cache_manager.cache_blocks(request, end)


def allocate_or_preempt(
    scheduler: Scheduler, request: Request, num_new: int, req_index: int, step: StepState
) -> tuple[KVCacheBlocks | None, int]:
    """Blocks for ``num_new`` tokens of the running request at ``running[req_index]``, preempting victims
    until they fit. Returns the new blocks (``None`` when the request itself was preempted) and the index
    the request has (or its successor has) now that victims left ``scheduler.running``."""
    running = scheduler.running
    while True:
        # Caching is deferred: a victim refunded below must not leave never-computed blocks cached.
        new_blocks = scheduler.kv_cache_manager.allocate_slots(
            request, num_new, num_lookahead_tokens=scheduler.num_lookahead_tokens, delay_cache_blocks=True
        )
        if new_blocks is not None:
            return new_blocks, req_index
        hook = "on_running_allocation_failed"
        try:
            if scheduler.on_running_allocation_failed(request):
                continue  # the policy released blocks outside the scheduler's requests: retry
            hook = "select_preemption_victim"
            victim = scheduler.select_preemption_victim(running, request)
            victim_index = next((i for i, r in enumerate(running) if r is victim), None)
            if victim_index is None:
                raise ValueError(f"returned {victim!r}, not a running request")
        except Exception as exc:
            del running[req_index]
            scheduler.fail_request(request, str(PluginHookError(scheduler, hook, exc)))
            return None, req_index
        if victim is request and never_fits(scheduler, request.num_computed_tokens + num_new):
            del running[req_index]
            scheduler.fail_request(request, never_fits_message(scheduler, request))
            return None, req_index
        del running[victim_index]
        if victim_index < req_index:
            req_index -= 1
        step.preempt(victim)
        scheduler._preempt_request(victim, step.now)
        if victim is request:
            return None, req_index


def admit_waiting(scheduler: Scheduler, step: StepState) -> None:
    """Admits waiting requests in queue order while budget, batch width and KV blocks last."""
    waiting = scheduler.waiting
    kv = scheduler.kv_cache_manager
    while waiting and step.token_budget > 0 and len(scheduler.running) < scheduler.max_num_running_reqs:
        request = waiting.peek_request()
        if request.num_computed_tokens == 0:
            hit_blocks, num_hit = kv.get_computed_blocks(request)
        else:
            hit_blocks, num_hit = kv.empty_kv_cache_blocks, 0
        num_new = num_new_waiting_tokens(scheduler, request, request.num_computed_tokens + num_hit, step)
        if num_new is None:
            break  # whole prompt or nothing
        lookahead = scheduler.num_lookahead_tokens
        if kv.allocate_slots(request, num_new, num_hit, hit_blocks, num_lookahead_tokens=lookahead) is not None:
            admit(scheduler, request, num_new, num_hit, step)
            continue
        try:
            released = scheduler.on_admission_blocked(request)
        except Exception as exc:
            waiting.remove_requests([request])
            scheduler.fail_request(request, str(PluginHookError(scheduler, "on_admission_blocked", exc)))
            continue
        if released:
            continue  # the policy released blocks: look at the (possibly new) head again
        if not never_fits(scheduler, request.num_computed_tokens + num_hit + num_new):
            break  # out of blocks: no preemption to admit
        waiting.remove_requests([request])
        scheduler.fail_request(request, never_fits_message(scheduler, request))


def num_new_waiting_tokens(scheduler: Scheduler, request: Request, num_computed: int, step: StepState) -> int | None:
    """Tokens to schedule for a waiting request with ``num_computed`` tokens computed or hit; ``None`` when
    its prompt does not fit the budget and chunked prefill is off."""
    num_new = request.num_tokens - num_computed
    if not scheduler.enable_chunked_prefill:
        return None if num_new > step.token_budget else num_new
    if 0 < scheduler.long_prefill_token_threshold < num_new:
        num_new = scheduler.long_prefill_token_threshold
    return min(num_new, step.token_budget)


def admit(scheduler: Scheduler, request: Request, num_new: int, num_hit: int, step: StepState) -> None:
    """Moves the head of the waiting queue, whose blocks are allocated, to running."""
    scheduler.waiting.pop_request()
    scheduler.running.append(request)
    step.admit(request, num_new, num_hit, resumed=request.status == RequestStatus.PREEMPTED)
    if scheduler.log_stats:
        request.record_event(EngineCoreEventType.SCHEDULED, step.now)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens += num_hit
    if request.num_cached_tokens < 0:
        request.num_cached_tokens = request.num_computed_tokens
    try:
        scheduler.on_request_admitted(request)
    except Exception as exc:
        # Its blocks are allocated for this step: the step computes them, then the request is failed.
        scheduler.fail_after_step[request.request_id] = str(PluginHookError(scheduler, "on_request_admitted", exc))
