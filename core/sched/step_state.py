"""``StepState``: what one ``Scheduler.schedule()`` call has decided so far, and the step's trace record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllite.kv_cache import KVCacheBlocks
    from vllite.request import Request
    from vllite.sched.output import SchedulerOutput
    from vllite.sched.scheduler import Scheduler


@dataclass(slots=True)
class StepState:
    """The token budget left in one step and the requests scheduled, admitted and preempted so far.

    Promise: ``num_scheduled_tokens`` lists exactly the requests in ``running``, ``new`` and ``resumed``, and
    ``token_budget + sum(num_scheduled_tokens.values()) == initial_budget``. ``lost_tokens`` and
    ``prefix_hits`` are filled only when ``tracing``.
    """

    now: float
    initial_budget: int
    tracing: bool = False
    token_budget: int = field(init=False)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)  # running requests only
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)  # scheduled requests that were already running
    new: list[Request] = field(default_factory=list)  # admitted for the first time
    resumed: list[Request] = field(default_factory=list)  # admitted again after a preemption
    preempted: list[Request] = field(default_factory=list)
    lost_tokens: dict[str, int] = field(default_factory=dict)  # preempted request -> computed tokens dropped
    prefix_hits: dict[str, int] = field(default_factory=dict)  # admitted request -> prefix-cache hit tokens

    def __post_init__(self) -> None:
        self.token_budget = self.initial_budget

    @property
    def total_scheduled_tokens(self) -> int:
        return self.initial_budget - self.token_budget

    @property
    def admitted(self) -> list[Request]:
        """Requests admitted from the waiting queue this step: new ones first, then resumed ones."""
        return self.new + self.resumed

    def schedule_running(self, request: Request, num_tokens: int, new_blocks: KVCacheBlocks) -> None:
        """A running request gets ``num_tokens`` tokens of the budget and ``new_blocks``."""
        request_id = request.request_id
        self.running.append(request)
        self.new_blocks[request_id] = new_blocks
        self.num_scheduled_tokens[request_id] = num_tokens
        self.token_budget -= num_tokens

    def admit(self, request: Request, num_tokens: int, num_hit_tokens: int, resumed: bool) -> None:
        """A waiting request (new, or ``resumed`` after a preemption) joins the batch with ``num_tokens``."""
        (self.resumed if resumed else self.new).append(request)
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        if self.tracing:
            self.prefix_hits[request.request_id] = num_hit_tokens

    def preempt(self, victim: Request) -> None:
        """Records a preemption (before the victim's progress is reset), refunding what it was scheduled."""
        victim_id = victim.request_id
        refund = self.num_scheduled_tokens.pop(victim_id, None)
        if refund is not None:
            self.token_budget += refund
            del self.new_blocks[victim_id]
            self.spec_tokens.pop(victim_id, None)
            self.running.remove(victim)
        if self.tracing:
            self.lost_tokens[victim_id] = victim.num_computed_tokens
        self.preempted.append(victim)


def make_step_record(scheduler: Scheduler, step: StepState, output: SchedulerOutput) -> dict[str, Any]:
    """The record of one step that the ``vllite_step_observer`` hook receives (built only when one listens)."""
    kv = scheduler.kv_cache_manager
    counts = output.num_scheduled_tokens
    return {
        "step": scheduler.step_counter,
        "time": step.now,
        "scheduler": type(scheduler).__name__,
        "num_waiting": len(scheduler.waiting),
        "num_running": len(scheduler.running),
        "free_blocks": kv.num_free_blocks,
        "cached_blocks": kv.num_cached_blocks,
        "kv_cache_usage": kv.usage,
        "token_budget": scheduler.max_num_scheduled_tokens,
        "total_scheduled_tokens": output.total_num_scheduled_tokens,
        "new": {r.request_id: counts[r.request_id] for r in step.new},
        "resumed": {r.request_id: counts[r.request_id] for r in step.resumed},
        "running": {r.request_id: counts[r.request_id] for r in step.running},
        "preempted": step.lost_tokens,
        "prefix_hits": step.prefix_hits,
        "spec_tokens": {k: len(v) for k, v in output.scheduled_spec_decode_tokens.items()},
    }
