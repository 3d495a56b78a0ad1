"""``SchedulerInterface``: what the engine core calls on a scheduler, and ``PauseState``.

Most schedulers subclass :class:`vllite.sched.Scheduler` and override a few policy decisions; a scheduler that
wants to own the whole algorithm implements this interface instead and is selected by class path
(``--scheduler-cls pkg.mod:MyScheduler``). The engine builds it as ``cls(config, num_blocks, log_stats=...,
clock=...)`` and builds ``Request`` objects with its ``block_hasher`` attribute (``None`` = no prefix caching).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllite.protocol import EngineCoreOutputs, SchedulerStats
    from vllite.request import BlockHasher, Request, RequestStatus
    from vllite.sched.output import ModelRunnerOutput, SchedulerOutput


class PauseState(enum.IntEnum):
    """Whether the scheduler admits and runs requests.

    ``UNPAUSED``: normal. ``PAUSED_NEW``: running requests continue, nothing is admitted from the waiting queue.
    ``PAUSED_ALL``: nothing is scheduled at all (the token budget is 0) and the scheduler reports no unfinished
    requests, so the engine goes idle with the requests frozen in place.
    """

    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


class SchedulerInterface(ABC):
    """The contract between the engine core and a scheduler.

    One engine step is ``schedule()`` → executor → ``update_from_output()``; aborts arrive through
    ``finish_requests`` between steps. All methods run on the engine-core thread; none is thread-safe.
    """

    #: Called on every ``Request`` the engine builds, to hash its full blocks for the prefix cache.
    block_hasher: BlockHasher | None = None
    #: KV connector (prefill/decode disaggregation); ``None`` when unused.
    connector: object | None = None

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Takes ownership of a new request and queues it as WAITING."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decides this step's batch: which requests run with how many tokens, and their KV blocks."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Applies the sampled tokens, checks stop conditions, frees finished requests; outputs per client."""

    @abstractmethod
    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> list[Request]:
        """Finishes requests in any state (``None`` = all) with ``finished_status``; unknown or already-finished
        ids are ignored. Returns the requests finished by this call."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int:
        """Requests still to be worked on (0 under ``PAUSED_ALL``; only running ones under ``PAUSED_NEW``)."""

    @abstractmethod
    def get_request_counts(self) -> tuple[int, int]:
        """``(num_running, num_waiting)``."""

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """Whether finished ids are waiting to be reported in the next step."""

    @property
    @abstractmethod
    def pause_state(self) -> PauseState:
        """The current :class:`PauseState`."""

    @abstractmethod
    def set_pause_state(self, pause_state: PauseState) -> None:
        """Switches the :class:`PauseState`; takes effect at the next ``schedule()``."""

    @abstractmethod
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets the prefix cache; with ``reset_running_requests`` running requests are preempted first.
        Returns whether the cache was reset."""

    @abstractmethod
    def make_stats(self) -> SchedulerStats | None:
        """Figures since the previous call, or ``None`` when stats are off."""

    @abstractmethod
    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Attaches speculative draft tokens to running requests, to be verified in the next step."""

    @abstractmethod
    def shutdown(self) -> None:
        """Releases resources (trace files, ...). Safe to call twice."""

    # ------------------------------------------------------------------ concrete defaults
    def has_unfinished_requests(self) -> bool:
        """Whether any request still needs steps."""
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        """Whether the engine should step: unfinished requests, or finished ids still to report."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    def get_kv_cache_usage(self) -> float:
        """The fraction of KV blocks in use (0.0 when unknown)."""
        return 0.0

    def get_kv_connector(self) -> object | None:
        """The KV connector, if any."""
        return self.connector

    def add_session_chunk(self, chunk: Request) -> None:
        """The next input chunk of a live session (a resumable request). Default: sessions are not supported."""
        from vllite.exceptions import SessionClosedError

        raise SessionClosedError(f"The scheduler {type(self).__name__} does not support sessions (resumable requests).")
