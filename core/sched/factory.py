"""``create_scheduler``: the scheduler class named by the config, resolved through the plugin manager."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

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
    kv_cache_groups: Sequence[int | None] = (),
    log_stats: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> SchedulerInterface:
    """Builds the scheduler named by ``config.scheduler_config.scheduler_name`` (``--scheduler-cls``, else
    ``--scheduling-policy``) over a KV cache of ``num_blocks`` blocks. ``sliding_window``: the window every
    attention layer of the model uses (``uniform_sliding_window``), so blocks outside it are freed; ``None`` keeps
    every block. ``kv_cache_groups``: the window of each KV-cache group when the model's layers form several (see
    ``vllite.kv_cache.hybrid``). Each is passed only when set, so schedulers without the keyword still serve
    full attention."""
    cls = resolve_scheduler_cls(config.scheduler_config.scheduler_name)
    layout = kv_layout_kwargs(sliding_window, kv_cache_groups)
    return cls(config, num_blocks, log_stats=log_stats, clock=clock, **layout)  # type: ignore[call-arg]


def kv_layout_kwargs(sliding_window: int | None, kv_cache_groups: Sequence[int | None]) -> dict[str, Any]:
    """The KV-cache layout keywords of a scheduler's constructor, only those that are set."""
    kwargs: dict[str, Any] = {}
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    if kv_cache_groups:
        kwargs["kv_cache_groups"] = tuple(kv_cache_groups)
    return kwargs
