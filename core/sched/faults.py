"""Fault isolation in the scheduler: a policy method that raises ends the request it was deciding about, never
the engine. Plain functions behind ``Scheduler``; ``vllite.sched.phases`` pins the failures of the allocation and
admission hooks (see its docstring), ``vllite.sched.updates`` sends the failed requests' ERROR outputs.

State on the scheduler: ``failed_requests`` (failed during ``schedule()``, their finish outputs go out with the next
``update_from_output``) and ``fail_after_step`` (``req_id -> message``: a hook failed after the request was
scheduled; its step computes the blocks already allocated, then the request is failed).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllite.exceptions import PluginHookError
from vllite.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllite.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


def step_start(scheduler: Scheduler) -> None:
    """Runs ``on_step_start``. Its failure cannot be pinned to a request: it is logged and the step goes on with
    the base behaviour (no housekeeping this step)."""
    try:
        scheduler.on_step_start()
    except Exception as exc:
        logger.error("%s; the step goes on without it.", PluginHookError(scheduler, "on_step_start", exc))


def release_finished(scheduler: Scheduler, request: Request) -> None:
    """Lets the policy free (or keep) a finished request's blocks. If ``on_request_finished`` raises, the blocks
    are freed the base way, so the pool stays whole, and the request ends with ERROR unless the client already gave
    up on it (aborted)."""
    try:
        scheduler.on_request_finished(request)
    except Exception as exc:
        scheduler.kv_cache_manager.free(request)
        error = PluginHookError(scheduler, "on_request_finished", exc)
        logger.error("Request %r: %s", request.request_id, error)
        if request.status != RequestStatus.FINISHED_ABORTED and request.error is None:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = str(error)


def fail_request(scheduler: Scheduler, request: Request, error: str) -> None:
    """``Scheduler.fail_request``: ERROR with ``error``, blocks freed, finish output queued."""
    logger.error("Request %r failed: %s", request.request_id, error)
    request.status = RequestStatus.FINISHED_ERROR
    request.error = error
    scheduler._free_request(request)
    scheduler.failed_requests.append(request)


def never_fits(scheduler: Scheduler, num_tokens: int) -> bool:
    """Whether ``num_tokens`` tokens of one request need more blocks than the whole cache has (block 0 is the null
    block): a block per ``block_size`` tokens in each full-attention KV-cache group. Never true when every layer
    uses a sliding window, whose requests hold a bounded number of blocks."""
    if scheduler.sliding_window is not None:
        return False
    kv = scheduler.kv_cache_manager
    return kv.min_blocks_for(num_tokens + scheduler.num_lookahead_tokens) > kv.num_blocks - 1


def never_fits_message(scheduler: Scheduler, request: Request) -> str:
    """The error of a request that cannot get KV blocks even with the whole cache to itself."""
    return (
        f"The KV cache ({scheduler.kv_cache_manager.num_blocks} blocks of {scheduler.block_size} "
        f"tokens) cannot hold request {request.request_id!r} ({request.num_tokens} tokens) even with nothing else "
        "running; raise the KV cache size or lower max_model_len."
    )
