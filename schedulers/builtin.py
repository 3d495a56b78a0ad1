"""The builtin scheduler plugin: registers ``fcfs`` and ``priority`` through the same hook third parties use."""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_schedulers(register: Register) -> None:
    """Registers ``fcfs`` (FCFSScheduler) and ``priority`` (PriorityScheduler)."""
    register("fcfs", "vllite.policies.fcfs:FCFSScheduler")
    register("priority", "vllite.policies.priority:PriorityScheduler")
