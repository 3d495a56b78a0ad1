"""The KV-connector contract, with vLLM's method names and meanings (``KVConnectorBase_V1``).

Per-step order (scheduler process, then worker):

1. ``Scheduler.add_request`` → ``on_new_request(request)``.
2. ``schedule()``, per waiting request, after the local prefix-cache hit: ``get_num_new_matched_tokens``; blocks
   are allocated for local + external tokens; ``update_state_after_alloc``.
3. End of ``schedule()``: ``build_connector_meta(scheduler_output)`` → ``SchedulerOutput.kv_connector_metadata``.
4. Worker: ``bind_connector_metadata`` → ``start_load_kv`` → per attention layer ``wait_for_layer_load`` and
   ``save_kv_layer`` → ``wait_for_save`` → ``get_finished`` / ``get_block_ids_with_load_errors`` →
   ``clear_connector_metadata``; the results travel back as ``KVConnectorOutput``.
5. ``update_from_output``: ``update_connector_output(output)``; for each finished request ``request_finished``
   (True keeps its blocks until the request id appears in ``finished_sending``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vllite.config import EngineConfig
    from vllite.kv_connector.config import KVTransferConfig
    from vllite.request import Request
    from vllite.sched.output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is: built separately, in the scheduler and in the executor."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """Scheduler → worker data for one step; a connector subclasses it (plain picklable fields only: it crosses
    the process boundary when the executor runs elsewhere)."""


@dataclass
class KVConnectorOutput:
    """Worker → scheduler results of one step.

    ``finished_sending``: requests whose KV the connector has finished saving (their blocks may be freed now);
    ``finished_recving``: requests whose asynchronous load has finished (they may be scheduled);
    ``invalid_block_ids``: blocks whose load failed (handled per ``kv_load_failure_policy``);
    ``kv_connector_stats``: the connector's own worker → scheduler values (``get_kv_connector_stats``; vLLM's
    field of that name), plain picklable data, ``None`` when there is nothing to report.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: dict[str, Any] | None = None

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids or self.kv_connector_stats)


class KVConnectorBase:
    """Base of every KV connector; ``cls(config, role, kv_transfer_config)``.

    A connector implements the methods of its roles. Scheduler-role methods run in the scheduler, on the engine's
    hot path, once per request or step: they must be cheap and must not block on I/O. Worker-role methods run in
    the executor around and inside the forward pass. Default implementations do nothing (a connector that never
    matches, loads or saves), so a connector overrides only what it needs.
    """

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        self.config = config
        self.role = role
        self.kv_transfer_config = kv_transfer_config
        self._metadata: KVConnectorMetadata | None = None

    # ------------------------------------------------------------------ scheduler role
    def on_new_request(self, request: Request) -> None:
        """A request arrived (``Scheduler.add_request``), before it is queued. Raising rejects the request."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens beyond the ``num_computed_tokens`` the local prefix cache already has can be loaded
        from outside, and whether the load is asynchronous.

        Called while scheduling a waiting request, possibly several times: side-effect free. ``None`` means "ask
        again in a later step" (the request waits without blocking the others). ``is_async`` must be False when
        the count is 0. The engine never loads the last prompt token (it must be computed to sample).
        """
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for the request (local hit + ``num_external_tokens`` + the tokens scheduled now):
        record what to load into which blocks. Decide from ``num_external_tokens`` (0: nothing to load), not from
        ``block_ids``. Called once per admission, again when an asynchronous load's request is resumed."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Once per step, at the end of ``schedule()``: this step's work for the worker. Resets the connector's
        per-step state. Must not change ``scheduler_output``."""
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The worker's results of a step, before the scheduler acts on them."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Exactly once per finished (or aborted) request, before its blocks are freed.

        Returns ``(delay_free, kv_transfer_params)``: ``delay_free`` True means the connector is still saving
        the request's KV, so its blocks stay allocated until the request id appears in ``finished_sending``;
        ``kv_transfer_params`` goes to the request's output (``RequestOutput.kv_transfer_params``).
        """
        return False, None

    # ------------------------------------------------------------------ worker role
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Before each forward pass: this step's metadata."""
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """After each forward pass."""
        self._metadata = None

    def has_connector_metadata(self) -> bool:
        """Whether metadata is bound (between ``bind_connector_metadata`` and ``clear_connector_metadata``)."""
        return self._metadata is not None

    @property
    def connector_metadata(self) -> KVConnectorMetadata:
        """The bound metadata (only between ``bind_connector_metadata`` and ``clear_connector_metadata``)."""
        if self._metadata is None:
            from vllite.exceptions import InternalStateError

            raise InternalStateError("KV connector metadata read outside a forward pass")
        return self._metadata

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Once, when the executor has allocated the paged KV cache: layer name → its KV tensor
        (``[2, num_blocks, block_size, num_kv_heads, head_dim]``)."""

    def start_load_kv(self, **kwargs: Any) -> None:
        """Before the forward pass: start loading this step's external KV into the paged cache (may return before
        the copies finish; ``wait_for_layer_load`` then waits per layer)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Inside attention, before layer ``layer_name`` reads its KV: block until that layer is loaded."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        """Inside attention, after layer ``layer_name`` wrote this step's KV: start saving what the metadata asks
        for (may be asynchronous)."""

    def wait_for_save(self) -> None:
        """After the forward pass, every step (empty ones too): finish or hand off this step's saves, so the
        paged cache may be overwritten."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """After the forward pass: ``(finished sending, finished receiving)`` request ids of asynchronous
        transfers. ``finished_req_ids`` are requests the scheduler finished this step."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the previous call."""
        return set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """After ``get_block_ids_with_load_errors``, every step: the connector's own values for its scheduler role
        since the previous call (they arrive in ``update_connector_output`` as
        ``KVConnectorOutput.kv_connector_stats``); ``None`` for nothing."""
        return None

    def shutdown(self) -> None:
        """Release threads, sockets and files; called once per instance (both roles)."""
