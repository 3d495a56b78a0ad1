"""The scheduler's contract with a KV connector's transfer machinery: ``KVTransfer``, what ``Scheduler`` and its
phases call, and ``make_kv_transfer``, which builds it only when ``config.kv_transfer_config`` is set.

The machinery itself (parking requests in ``WAITING_FOR_REMOTE_KVS``, delayed frees, held blocks, load failures,
lookup stats) is the KV-connector plugin's: ``vllite.plugins.kv_connectors.scheduling``. It is resolved by class
path when an engine is configured with a connector, so an engine without one never imports it; the scheduler
holds ``None`` instead and every hot path stays one check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from vllite.registry import resolve_class_path

if TYPE_CHECKING:
    from vllite.kv_cache.manager import PrefixCacheStats
    from vllite.kv_connector.base import KVConnectorBase, KVConnectorOutput
    from vllite.request import Request
    from vllite.sched.output import SchedulerOutput
    from vllite.sched.scheduler import Scheduler

#: Builds the scheduler side from a scheduler whose config names a connector (the builtin plugin's).
KV_TRANSFER_BUILDER = "vllite.plugins.kv_connectors.scheduling:make_kv_transfer"


class KVTransfer(Protocol):
    """The scheduler-role connector and its transfer bookkeeping, as the scheduler uses them.

    ``held``: finished requests whose blocks stay allocated for the connector → what is still awaited
    (``"send"``, ``"recv"``); ``unverified``: requests admitted with a synchronous load this step (their blocks
    are cached once no load failure is reported)."""

    connector: KVConnectorBase
    held: dict[str, tuple[Request, set[str]]]
    unverified: list[Request]

    def shutdown(self) -> None:
        """Shuts the connector down, once."""
        ...

    def lookup(self, request: Request, num_computed: int) -> tuple[int, bool] | None:
        """External tokens beyond ``num_computed`` and whether they load asynchronously; ``None``: ask again next
        step."""
        ...

    def record_lookup(self, request: Request, num_external: int) -> None:
        """Counts the lookup of an admitted request."""
        ...

    def take_lookup_stats(self) -> PrefixCacheStats:
        """The lookups counted since the previous call."""
        ...

    def park(self, request: Request, num_computed_when_loaded: int) -> None:
        """An asynchronous load was set up for ``request``: it waits for the worker (``WAITING_FOR_REMOTE_KVS``)."""
        ...

    def try_unblock(self, scheduler: Scheduler, request: Request) -> bool:
        """Whether a blocked waiting request may be admitted now (its load has landed)."""
        ...

    def release_landed(self, scheduler: Scheduler, skipped: list[Request], head: Request) -> bool:
        """Admission is out of blocks and nothing runs: frees the blocks of one waiting request whose load has
        landed; False when there is none."""
        ...

    def hold_finished(self, scheduler: Scheduler, request: Request) -> bool:
        """``request_finished`` (once per request); True when the blocks stay allocated for the connector."""
        ...

    def build_meta(self, output: SchedulerOutput) -> None:
        """The connector's metadata for this step, onto ``output``."""
        ...

    def update_from_output(
        self, scheduler: Scheduler, kv_output: KVConnectorOutput | None
    ) -> frozenset[str] | set[str]:
        """Applies the worker's transfer results; returns the running requests whose tokens of this step must be
        dropped (their KV load failed and they recompute)."""
        ...


def make_kv_transfer(scheduler: Scheduler) -> KVTransfer | None:
    """The scheduler side of the connector named by ``config.kv_transfer_config``, or ``None`` without one."""
    if getattr(scheduler.config, "kv_transfer_config", None) is None:
        return None
    build = resolve_class_path(KV_TRANSFER_BUILDER)
    kv_transfer: KVTransfer | None = build(scheduler)
    return kv_transfer
