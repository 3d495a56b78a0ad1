"""``create_scheduler``: the scheduler class named by the config, resolved through the plugin manager."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllite.exceptions import PluginLoadError
from vllite.sched.interface import SchedulerInterface

if TYPE_CHECKING:
    from vllite.config import EngineConfig


def resolve_scheduler_cls(name_or_path: str | type) -> type[SchedulerInterface]:
    """A registered scheduler name (``fcfs``, ``priority``, a plugin's), a class path (``pkg.mod:Class`` or
    ``pkg.mod.Class``) or a class → the class; ``PluginLoadError`` when it is no ``SchedulerInterface``."""
    from vllite.plugin_manager import resolve_component

    cls = resolve_component("schedulers", name_or_path)
    if not (isinstance(cls, type) and issubclass(cls, SchedulerInterface)):
        raise PluginLoadError(
            f"Scheduler {name_or_path!r} resolved to {cls!r}, which is not a vllite.sched.SchedulerInterface "
            "subclass (subclass vllite.sched.Scheduler and override its policy methods).",
            plugin=str(name_or_path),
        )
    return cls


def create_scheduler(
    config: EngineConfig,
    num_blocks: int,
    *,
    sliding_window: int | None = None,
    log_stats: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> SchedulerInterface:
    """Builds the scheduler named by ``config.scheduler_config.scheduler_name`` (``--scheduler-cls``, else
    ``--scheduling-policy``) over a KV cache of ``num_blocks`` blocks. ``sliding_window``: the window every
    attention layer of the model uses (``uniform_sliding_window``), so blocks outside it are freed; ``None`` keeps
    every block. It is passed only when set, so schedulers without the keyword still serve full attention."""
    cls = resolve_scheduler_cls(config.scheduler_config.scheduler_name)
    window = {"sliding_window": sliding_window} if sliding_window is not None else {}
    return cls(config, num_blocks, log_stats=log_stats, clock=clock, **window)  # type: ignore[call-arg]
