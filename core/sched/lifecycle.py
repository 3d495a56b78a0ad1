"""Requests entering and leaving the scheduler: the checks and hooks of ``add_request`` and the bookkeeping of
``finish_requests``. Plain functions behind ``Scheduler``, like ``phases`` and ``updates``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllite.exceptions import PluginHookError
from vllite.protocol import EngineCoreEventType
from vllite.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllite.sched.scheduler import Scheduler


def add_request(scheduler: Scheduler, request: Request) -> None:
    """Registers a request and queues it as WAITING; ``ValueError`` for a duplicate id, an empty prompt, or a
    prompt longer than ``max_model_len``."""
    if request.request_id in scheduler.requests:
        raise ValueError(f"Request id {request.request_id!r} is already in the scheduler.")
    kv_transfer = scheduler.kv_transfer
    if kv_transfer is not None and request.request_id in kv_transfer.held:
        raise ValueError(
            f"Request id {request.request_id!r} is still in use: the KV connector is transferring the KV of "
            "the finished request of that id."
        )
    if request.num_tokens == 0:
        raise ValueError(f"Request {request.request_id!r} has an empty prompt.")
    if request.num_tokens > scheduler.max_model_len:
        raise ValueError(
            f"Request {request.request_id!r} has {request.num_tokens} tokens, more than max_model_len "
            f"({scheduler.max_model_len})."
        )
    try:
        scheduler.on_request_arrival(request)
    except Exception as exc:  # not registered yet: the engine rejects it with this error
        raise PluginHookError(scheduler, "on_request_arrival", exc) from exc
    if kv_transfer is not None:
        try:
            kv_transfer.connector.on_new_request(request)
        except Exception as exc:
            raise PluginHookError(kv_transfer.connector, "on_new_request", exc) from exc
    scheduler.requests[request.request_id] = request
    scheduler.waiting.add_request(request)
    if scheduler.log_stats:
        request.record_event(EngineCoreEventType.QUEUED, scheduler.clock())


def finish_requests(
    scheduler: Scheduler, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
) -> list[Request]:
    """Finishes requests in any state (``None`` = every request) with ``finished_status``.

    Unknown and already-finished ids are ignored, so aborting twice is harmless. Finished ids are reported
    to the workers in the next ``SchedulerOutput`` and to the clients in the next outputs.
    """
    if not RequestStatus.is_finished(finished_status):
        raise ValueError(f"finish_requests needs a finished status, got {finished_status!r}.")
    if request_ids is None:
        request_ids = list(scheduler.requests)
    elif isinstance(request_ids, str):
        request_ids = (request_ids,)
    finished: list[Request] = []
    from_running: set[Request] = set()
    from_waiting: list[Request] = []
    for request_id in request_ids:
        request = scheduler.requests.get(request_id)
        if request is None or request.is_finished():
            continue
        if request.status == RequestStatus.RUNNING:
            from_running.add(request)
        else:
            from_waiting.append(request)
        request.status = finished_status
        scheduler._free_request(request)
        finished.append(request)
    if from_running:
        scheduler.running[:] = [r for r in scheduler.running if r not in from_running]
    if from_waiting:
        scheduler.waiting.remove_requests(from_waiting)
    return finished
