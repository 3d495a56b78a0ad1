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

from typing import TYPE_CHECKING, Any

from vllite.exceptions import PluginHookError
from vllite.kv_cache.manager import KVCacheManager
from vllite.kv_cache.single_type import FullAttentionManager
from vllite.protocol import EngineCoreEventType
from vllite.request import Request, RequestStatus
from vllite.sched.async_placeholders import num_new_tokens_ahead
from vllite.sched.faults import never_fits, never_fits_message
from vllite.sched.sessions import release_for_memory

if TYPE_CHECKING:
    from vllite.kv_cache import KVCacheBlocks
    from vllite.sched.scheduler import Scheduler
    from vllite.sched.step_state import StepState


def schedule_running(scheduler: Scheduler, step: StepState) -> None:
    """Serves running requests in admission order, preempting when one cannot get blocks.

    Hot path: with the stock KV cache manager over full attention and no lookahead, a request whose blocks
    already hold its new tokens skips ``allocate_slots`` (which would allocate nothing and change nothing), and
    a request with no newly full block skips ``cache_blocks``.
    """
    running = scheduler.running
    kv = scheduler.kv_cache_manager
    held_blocks = _held_blocks_if_plain(scheduler)
    block_size, no_blocks = kv.block_size, kv.empty_kv_cache_blocks
    long_prefill, max_model_len = scheduler.long_prefill_token_threshold, scheduler.max_model_len
    req_index = 0
    while req_index < len(running) and step.token_budget > 0:
        request = running[req_index]
        computed = request.num_computed_tokens
        num_new = request.num_tokens_with_spec - computed
        if request.num_output_placeholders:  # async scheduling: the next decode ahead of its input token, or wait
            num_new = num_new_tokens_ahead(request, computed)
        if 0 < long_prefill < num_new:
            num_new = long_prefill
        # Never schedule a position at or past max_model_len.
        num_new = min(num_new, step.token_budget, max_model_len - computed)
        if num_new <= 0:
            req_index += 1
            continue
        held = held_blocks.get(request.request_id) if held_blocks is not None else None
        if held is not None and len(held) * block_size >= computed + num_new:
            step.schedule_running(request, num_new, no_blocks)
        else:
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
        num_cached = kv.manager.num_cached_block if held_blocks is not None else None
        num_scheduled = step.num_scheduled_tokens
        for request in step.running:
            end = request.num_computed_tokens + num_scheduled[request.request_id]
            if num_cached is not None and min(end, request.num_tokens) // block_size <= num_cached.get(
                request.request_id, 0
            ):
                continue  # no block becomes full: cache_blocks would do nothing
            kv.cache_blocks(request, end)


def _held_blocks_if_plain(scheduler: Scheduler) -> dict[str, list[Any]] | None:
    """The stock full-attention manager's ``request_id -> blocks`` map when ``allocate_slots`` may be skipped for
    a request whose blocks suffice (no subclass that could change allocation, no sliding window, no lookahead)."""
    kv = scheduler.kv_cache_manager
    if type(kv) is not KVCacheManager or type(kv.manager) is not FullAttentionManager:
        return None
    if "allocate_slots" in vars(kv) or "cache_blocks" in vars(kv):  # patched on the instance (tests, tracing)
        return None
    if scheduler.num_lookahead_tokens:
        return None
    return kv.manager.req_to_blocks


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
        if scheduler.session_holds and _release_held_blocks(scheduler, request, num_new):
            continue  # a parked session's tail blocks were released: retry
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


def _release_held_blocks(scheduler: Scheduler, request: Request, num_new: int) -> bool:
    """Held sessions give up the blocks the running ``request`` lacks for ``num_new`` tokens; whether one did."""
    kv = scheduler.kv_cache_manager
    num_short = kv.get_num_blocks_short(request, num_new, num_lookahead_tokens=scheduler.num_lookahead_tokens)
    return release_for_memory(scheduler, num_short, request.request_id)


def admit_waiting(scheduler: Scheduler, step: StepState) -> None:
    """Admits waiting requests in queue order while budget, batch width and KV blocks last.

    Requests blocked on something outside the scheduler (``RequestStatus.is_blocked_waiting``: a KV load in
    flight) and requests the KV connector defers (``None`` matched tokens) are set aside for this step without
    holding up the requests behind them, and go back into the queue, in their order, when admission ends. So
    is a request whose LoRA adapter would exceed ``max_loras`` distinct adapters among the running requests
    (vLLM's per-step LoRA budget, counted over every running request so that no step can exceed it).
    """
    waiting = scheduler.waiting
    skipped: list[Request] = []
    try:
        _admit_waiting(scheduler, step, skipped, _running_loras(scheduler))
    finally:
        if skipped:
            waiting.requeue_skipped(skipped)


def _running_loras(scheduler: Scheduler) -> set[int] | None:
    if scheduler.max_loras is None:
        return None
    return {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request is not None}


def _lora_over_budget(scheduler: Scheduler, request: Request, loras: set[int] | None) -> bool:
    """Whether ``request`` brings a new adapter when ``max_loras`` are already running; else counts it in."""
    if loras is None or request.lora_request is None or request.lora_request.lora_int_id in loras:
        return False
    if len(loras) >= (scheduler.max_loras or 0):
        return True
    loras.add(request.lora_request.lora_int_id)
    return False


def _admit_waiting(scheduler: Scheduler, step: StepState, skipped: list[Request], loras: set[int] | None) -> None:
    """Admits from the head of the waiting queue until the budget, the batch width or the KV blocks run out; the
    requests set aside for this step go to ``skipped`` (see :func:`admit_waiting`)."""
    waiting = scheduler.waiting
    kv = scheduler.kv_cache_manager
    kv_transfer = scheduler.kv_transfer
    while waiting and step.token_budget > 0 and len(scheduler.running) < scheduler.max_num_running_reqs:
        request = waiting.peek_request()
        if (
            RequestStatus.is_blocked_waiting(request.status) and not try_unblock(scheduler, request)
        ) or _lora_over_budget(scheduler, request, loras):
            skipped.append(waiting.pop_request())
            continue
        num_external, load_async = 0, False
        if request.num_computed_tokens == 0:
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            if kv_transfer is not None:
                matched = _match_external(scheduler, request, num_hit, skipped)
                if matched is None:
                    continue  # failed, or deferred to the next step: no longer the head
                num_external, load_async = matched
        else:
            hit_blocks, num_hit = kv.empty_kv_cache_blocks, 0
        num_computed = request.num_computed_tokens + num_hit + num_external
        num_new = 0  # with an asynchronous load: the load comes first, nothing is computed until it lands
        if not load_async:
            num_to_compute = num_new_waiting_tokens(scheduler, request, num_computed, step)
            if num_to_compute is None:
                break  # whole prompt or nothing
            num_new = num_to_compute
        lookahead = 0 if load_async else scheduler.num_lookahead_tokens
        num_needed, num_short = _admission_gates(scheduler, request, num_computed + num_new, num_hit, hit_blocks)
        # Externally loaded blocks are cached only once the load is known to have worked.
        new_blocks = None
        if not num_short:
            new_blocks = kv.allocate_slots(
                request,
                num_external + num_new,
                num_hit,
                hit_blocks,
                num_lookahead_tokens=lookahead,
                delay_cache_blocks=num_external > 0,
            )
        if new_blocks is not None:
            _place_allocated(scheduler, request, num_new, num_hit, num_external, load_async, step, skipped)
            continue
        num_short = num_short or kv.get_num_blocks_short(
            request, num_external + num_new, num_hit, hit_blocks, lookahead
        )
        if not _retry_blocked_head(scheduler, request, num_needed, num_short, skipped):
            break  # out of blocks: no preemption to admit


def _admission_gates(
    scheduler: Scheduler, request: Request, num_tokens: int, num_hit: int, hit_blocks: KVCacheBlocks
) -> tuple[int, int]:
    """The admission gates for the head of the waiting queue, which this step would compute up to ``num_tokens``
    tokens: the tokens that must fit (``Scheduler.admission_num_tokens``) and the blocks they lack with
    ``Scheduler.admission_reserved_blocks`` kept free (0: the gates let it through to ``allocate_slots``)."""
    num_needed = max(num_tokens, scheduler.admission_num_tokens(request, num_tokens))
    reserved = scheduler.admission_reserved_blocks(request)
    if num_needed == num_tokens and not reserved:
        return num_tokens, 0  # the allocation of this step's tokens decides alone
    num_new = num_needed - request.num_computed_tokens - num_hit
    kv = scheduler.kv_cache_manager
    num_short = kv.get_num_blocks_short(
        request, num_new, num_hit, hit_blocks, scheduler.num_lookahead_tokens, reserved_blocks=reserved
    )
    return num_needed, num_short


def _match_external(
    scheduler: Scheduler, request: Request, num_hit: int, skipped: list[Request]
) -> tuple[int, bool] | None:
    """The KV connector's ``(num_external_tokens, load_async)`` for the head of the waiting queue, beyond its
    ``num_hit`` prefix-cache tokens; ``None`` when the request left the head: set aside in ``skipped`` (the
    connector asks again next step) or failed (the connector raised)."""
    kv_transfer = scheduler.kv_transfer
    assert kv_transfer is not None
    try:
        matched = kv_transfer.lookup(request, num_hit)
    except Exception as exc:
        scheduler.waiting.pop_request()
        error = PluginHookError(kv_transfer.connector, "get_num_new_matched_tokens", exc)
        scheduler.fail_request(request, str(error))
        return None
    if matched is None:
        skipped.append(scheduler.waiting.pop_request())
    return matched


def _place_allocated(
    scheduler: Scheduler,
    request: Request,
    num_new: int,
    num_hit: int,
    num_external: int,
    load_async: bool,
    step: StepState,
    skipped: list[Request],
) -> None:
    """Takes the head of the waiting queue, whose blocks are now allocated, out of the queue: admitted with
    ``num_new`` tokens, parked in ``skipped`` while its KV loads asynchronously, or failed when the KV connector
    raised."""
    kv_transfer = scheduler.kv_transfer
    if kv_transfer is None:
        admit(scheduler, request, num_new, num_hit, step)
        return
    if not _after_alloc(scheduler, request, num_external):
        return
    if request.num_computed_tokens == 0:  # the connector was asked this step (not a load that has landed)
        kv_transfer.record_lookup(request, num_external)
    if load_async:
        scheduler.waiting.pop_request()
        kv_transfer.park(request, request.num_computed_tokens + num_hit + num_external)
        skipped.append(request)
        return
    admit(scheduler, request, num_new, num_hit + num_external, step)
    if num_external:
        kv_transfer.unverified.append(request)


def _retry_blocked_head(
    scheduler: Scheduler, request: Request, num_needed: int, num_short: int, skipped: list[Request]
) -> bool:
    """The head of the waiting queue cannot get blocks for ``num_needed`` tokens (``num_short`` blocks are
    missing). Held sessions keep their blocks while requests run (they will free blocks); with none running, the
    hold that expires first gives up its tail blocks. True when admission goes on with the (possibly new) head: a
    hold, the policy or the KV connector released blocks, or the request can never fit and was failed (as it was
    when ``on_admission_blocked`` raised); False when admission stops for this step. A head that holds no blocks
    is set aside for this step while sessions holding theirs wait behind it: they need only their new tokens'
    blocks, and each one admitted is a program going on."""
    holds = scheduler.session_holds
    if holds and not holds.is_queued(request.request_id) and holds.num_queued:
        skipped.append(scheduler.waiting.pop_request())
        return True
    if not scheduler.running and release_for_memory(scheduler, num_short, request.request_id):
        return True  # nothing runs that would free blocks: a held session gives way
    try:
        released = scheduler.on_admission_blocked(request)
    except Exception as exc:
        scheduler.waiting.remove_requests([request])
        scheduler.fail_request(request, str(PluginHookError(scheduler, "on_admission_blocked", exc)))
        return True
    if released:
        return True
    kv_transfer = scheduler.kv_transfer
    if kv_transfer is not None and not scheduler.running and kv_transfer.release_landed(scheduler, skipped, request):
        return True  # blocks of a landed load were released: try again
    if not never_fits(scheduler, num_needed):
        return False
    scheduler.waiting.remove_requests([request])
    scheduler.fail_request(request, never_fits_message(scheduler, request))
    return True


def try_unblock(scheduler: Scheduler, request: Request) -> bool:
    """Whether a request in a blocked waiting status may be admitted now (its dependency resolved)."""
    if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and scheduler.kv_transfer is not None:
        return scheduler.kv_transfer.try_unblock(scheduler, request)
    return False


def _after_alloc(scheduler: Scheduler, request: Request, num_external: int) -> bool:
    """``update_state_after_alloc``; False when it raised (the request is then failed, its blocks freed)."""
    kv_transfer = scheduler.kv_transfer
    assert kv_transfer is not None
    request.num_external_computed_tokens = num_external
    try:
        kv_transfer.connector.update_state_after_alloc(
            request, scheduler.kv_cache_manager.get_block_ids(request.request_id), num_external
        )
    except Exception as exc:
        scheduler.waiting.pop_request()
        error = PluginHookError(kv_transfer.connector, "update_state_after_alloc", exc)
        scheduler.fail_request(request, str(error))
        return False
    return True


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
    if request.resumable:
        scheduler.session_holds.discard(request.request_id)  # a session's next turn: its blocks are in use again
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
