"""Scheduling: the token-budget algorithm (``Scheduler``), its interface, queues and per-step output.

Policies (``fcfs``, ``priority``, ``continuum``, third-party ones) are subclasses of ``Scheduler`` that override a
few decisions; they are registered through ``vllite_register_schedulers`` and built by :func:`create_scheduler`.
"""

from vllite import deprecated_aliases
from vllite.sched.factory import create_scheduler, resolve_scheduler_cls
from vllite.sched.interface import PauseState, SchedulerInterface
from vllite.sched.output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from vllite.sched.request_queue import FCFSRequestQueue, RequestQueue
from vllite.sched.scheduler import Scheduler
from vllite.sched.stop import check_stop

__all__ = [
    "CachedRequestData",
    "FCFSRequestQueue",
    "ModelRunnerOutput",
    "NewRequestData",
    "PauseState",
    "RequestQueue",
    "Scheduler",
    "SchedulerInterface",
    "SchedulerOutput",
    "check_stop",
    "create_scheduler",
    "resolve_scheduler_cls",
]


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)  # the priority heap, now the priority policy's
