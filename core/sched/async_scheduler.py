"""Async scheduling (``--async-scheduling``): a scheduler that plans step N+1 while step N runs.

:func:`create_async_scheduler` builds the configured scheduler class (any :class:`~vllite.sched.Scheduler`
subclass: FCFS, priority, a plugin's policy) with :class:`AsyncSchedulingMixin` in front of it. The engine core
then keeps two batches in flight (``EngineCore.step_with_batch_queue``): it schedules step N+1 before step N's
output is applied, so every request that samples in step N holds an output placeholder and is scheduled again at
its next position (:mod:`vllite.sched.async_placeholders`). When step N's output arrives the placeholders are
filled and the stop conditions checked as in the synchronous path; a request that stopped there is already freed,
and step N+1's token for it is dropped (``update_from_output`` skips finished requests).

Blocks are freed once, when the request finishes or is aborted, even while step N+1 (which uses them) is in
flight: the executor runs steps in order, so a freed block can only be handed to a request of a step scheduled
later, which executes after step N+1 has written and read its KV.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vllite.sched.factory import kv_layout_kwargs, resolve_scheduler_cls
from vllite.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from vllite.config import EngineConfig
    from vllite.protocol import EngineCoreOutputs
    from vllite.request import Request
    from vllite.sched.interface import SchedulerInterface
    from vllite.sched.output import ModelRunnerOutput, SchedulerOutput


def check_async_scheduling(config: EngineConfig) -> None:
    """``ValueError`` naming both flags for what async scheduling cannot serve yet: speculative decoding (drafts
    are proposed from the previous step's tokens) and a KV connector (its per-step metadata assumes known
    tokens). Structured outputs are served: constrained requests simply wait for their tokens. Called when an
    engine is created, before anything loads (``vllite.engine.frontend.load_frontend_parts``), and by
    :func:`create_async_scheduler`."""
    if config.speculative_config is not None:
        raise ValueError("--async-scheduling cannot be combined with --speculative-config yet: turn one of them off.")
    if config.kv_transfer_config is not None:
        raise ValueError(
            "--async-scheduling cannot be combined with --kv-transfer-config (or --kv-offload-size) yet: turn "
            "one of them off."
        )


class AsyncSchedulingMixin(Scheduler):
    """Output placeholders on top of a scheduler policy (placed first in the MRO by :func:`async_scheduler_cls`).

    ``schedule()`` gives every request that will sample in the step one placeholder; ``update_from_output``
    (called in the order the steps were scheduled) releases that step's placeholders before the sampled tokens
    are applied, so the stop checks and ``max_tokens`` see exactly the tokens of the synchronous path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Per step scheduled and not yet updated, in order: the requests that hold a placeholder for it.
        self._placeholder_steps: deque[list[str]] = deque()

    def add_request(self, request: Request) -> None:
        """As the policy's, but a session is refused: its turn could end with a step in flight for it."""
        if request.resumable:
            raise ValueError(
                f"Request {request.request_id!r} is a session (resumable request); sessions need the engine "
                "without --async-scheduling."
            )
        super().add_request(request)

    def schedule(self) -> SchedulerOutput:
        """The policy's step; each request whose scheduled tokens reach its end gets a placeholder."""
        output = super().schedule()
        requests = self.requests
        sampling: list[str] = []
        for request_id in output.num_scheduled_tokens:
            request = requests[request_id]
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
                sampling.append(request_id)
        self._placeholder_steps.append(sampling)
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Fills the oldest step's placeholders with its tokens (stop checks as in the synchronous path)."""
        requests = self.requests
        for request_id in self._placeholder_steps.popleft():
            request = requests.get(request_id)
            if request is not None:  # gone: finished or aborted while the step ran; its token is dropped
                request.num_output_placeholders -= 1
        return super().update_from_output(scheduler_output, model_runner_output)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps scheduled whose output has not been applied yet."""
        return len(self._placeholder_steps)


_ASYNC_CLASSES: dict[type, type] = {}


def async_scheduler_cls(cls: type[SchedulerInterface]) -> type[AsyncSchedulingMixin]:
    """``cls`` with output placeholders (one class per policy, cached); ``ValueError`` for a scheduler that is
    not a :class:`~vllite.sched.Scheduler` (its token accounting is its own)."""
    if not issubclass(cls, Scheduler):
        raise ValueError(
            f"--async-scheduling needs a scheduler derived from vllite.sched.Scheduler; {cls.__qualname__} is not: "
            "turn --async-scheduling off or use such a --scheduler-cls."
        )
    if issubclass(cls, AsyncSchedulingMixin):
        return cls
    async_cls = _ASYNC_CLASSES.get(cls)
    if async_cls is None:
        async_cls = type(f"Async{cls.__name__}", (AsyncSchedulingMixin, cls), {"__module__": cls.__module__})
        _ASYNC_CLASSES[cls] = async_cls
    return async_cls


def create_async_scheduler(
    config: EngineConfig,
    num_blocks: int,
    *,
    sliding_window: int | None = None,
    kv_cache_groups: Sequence[int | None] = (),
    log_stats: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncSchedulingMixin:
    """:func:`vllite.sched.create_scheduler` for ``--async-scheduling``: the configured policy with output
    placeholders, after :func:`check_async_scheduling`."""
    check_async_scheduling(config)
    cls = async_scheduler_cls(resolve_scheduler_cls(config.scheduler_config.scheduler_name))
    layout = kv_layout_kwargs(sliding_window, kv_cache_groups)
    return cls(config, num_blocks, log_stats=log_stats, clock=clock, **layout)
