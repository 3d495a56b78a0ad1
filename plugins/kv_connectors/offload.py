"""``offload``: a bounded second KV tier in host memory, keyed by block hash; a prefix cache larger than the KV cache.

``--kv-offload-size GiB`` (without ``--kv-transfer-config``), or ``--kv-transfer-config '{"kv_connector":
"offload", "kv_connector_extra_config": {"offload_size_gib": 4}}'`` (1 GiB when not given).

With ``"offload_dir": PATH`` the tier gets a second layer on disk, bounded by ``offload_disk_size_gib`` (default
4): blocks memory evicts are written there (checksummed files in a private folder, removed at shutdown) and loaded
back from there, so the tier can be far larger than host memory (:mod:`vllite.plugins.kv_connectors.offload_disk`).

Every full prompt block the engine computes is copied to the tier (write-through: when the engine's prefix cache
later evicts the block, the tier still has it), named by the SHA-256 hash chain of the prefix that ends with it
(token ids, plus LoRA adapter and cache salt as the prefix cache hashes them). The tier is an LRU bounded by bytes
(``offload_size_gib``); loading a block refreshes it.

Scheduler role: ``get_num_new_matched_tokens`` is the longest prefix the tier holds beyond the local hit (never
the prompt's last token), loaded asynchronously: the request waits in ``WAITING_FOR_REMOTE_KVS`` while the
worker copies the blocks in on a background thread, and is scheduled once ``get_finished`` reports it. The
scheduler role knows which blocks the tier holds from the worker's reports (``kv_connector_stats`` of each step's
``KVConnectorOutput``: the names stored and evicted), so the two roles share no object and would work across
processes. A block evicted between the lookup and the load is a reported load error (recomputed or failed per
``kv_load_failure_policy``). The per-request bookkeeping (block names, loads, saves) is a
:class:`~vllite.plugins.kv_connectors.prefix_blocks.PrefixBlockTracker` asking ``held`` (the reports). Worker
role: :mod:`vllite.plugins.kv_connectors.offload_worker`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllite.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole
from vllite.plugins.kv_connectors.prefix_blocks import PrefixBlockTracker
from vllite.plugins.kv_connectors.transfers import BlockTransfer, BlockTransferMetadata

if TYPE_CHECKING:
    import torch

    from vllite.config import EngineConfig
    from vllite.kv_connector.config import KVTransferConfig
    from vllite.plugins.kv_connectors.offload_worker import OffloadWorker
    from vllite.request import Request
    from vllite.sched.output import SchedulerOutput

#: ``offload_size_gib`` when the extra config does not say.
DEFAULT_OFFLOAD_SIZE_GIB = 1.0
#: ``offload_disk_size_gib`` when ``offload_dir`` is given and the extra config does not say.
DEFAULT_OFFLOAD_DISK_SIZE_GIB = 4.0


def offload_capacity_bytes(kv_transfer_config: KVTransferConfig, key: str = "offload_size_gib") -> int:
    """``offload_size_gib`` (or ``key``) in bytes; ``ValueError`` naming the field unless it is a positive number."""
    default = DEFAULT_OFFLOAD_SIZE_GIB if key == "offload_size_gib" else DEFAULT_OFFLOAD_DISK_SIZE_GIB
    size = kv_transfer_config.get_from_extra_config(key, default)
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config.{key} must be a positive number of GiB "
            f"for the offload connector, got {size!r}."
        )
    return int(size * 2**30)


def offload_disk(kv_transfer_config: KVTransferConfig) -> tuple[Path, int] | None:
    """``(offload_dir, disk bytes)`` when the disk layer is configured; ``ValueError`` naming a bad field."""
    folder = kv_transfer_config.get_from_extra_config("offload_dir", None)
    if folder is None:
        return None
    if not isinstance(folder, str) or not folder:
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config.offload_dir must be a folder path, got {folder!r}."
        )
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.offload_dir {folder!r} is not a folder.")
    return path, offload_capacity_bytes(kv_transfer_config, "offload_disk_size_gib")


@dataclass
class OffloadMetadata(BlockTransferMetadata):
    """One step's work for the worker: blocks to load from the tier, blocks to copy to it."""


class OffloadConnector(KVConnectorBase):
    """Both roles of the ``offload`` connector (registered under that name by the builtin plugin)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        super().__init__(config, role, kv_transfer_config)
        self.capacity_bytes = offload_capacity_bytes(kv_transfer_config)
        disk = offload_disk(kv_transfer_config)
        self.block_size = config.cache_config.block_size
        self.prefix_blocks = PrefixBlockTracker(self.block_size, hashlib.sha256(b"vllite.offload").digest(), self._held)
        self.held: set[str] = set()  # names the tier holds, as the worker last reported (scheduler role)
        self._loads: list[BlockTransfer] = []  # set up since the last build_connector_meta
        self.num_loads = 0  # asynchronous loads set up (scheduler role)
        self.num_loaded_tokens = 0
        self.worker: OffloadWorker | None = None
        if role == KVConnectorRole.WORKER:
            from vllite.plugins.kv_connectors.offload_disk import DiskTier
            from vllite.plugins.kv_connectors.offload_worker import OffloadWorker

            self.worker = OffloadWorker(self.capacity_bytes, DiskTier(*disk) if disk is not None else None)

    # ------------------------------------------------------------------ scheduler role
    def _held(self, name: str) -> bool:
        """Whether the tier holds ``name``, as the worker last reported."""
        return name in self.held

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prefix the tier holds beyond ``num_computed_tokens``, excluding the prompt's last token; async."""
        consumer = self.kv_transfer_config.is_kv_consumer and bool(self.held)
        num = self.prefix_blocks.matched_tokens(request, num_computed_tokens, consumer)
        return num, num > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The external blocks start loading in the next step, asynchronously."""
        load = self.prefix_blocks.take_load(self.prefix_blocks.allocated(request, block_ids, num_external_tokens))
        if load is None:
            return
        self._loads.append(load)
        self.num_loads += 1
        self.num_loaded_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The loads set up since the previous step, and (for ``kv_producer`` / ``kv_both``) the full prompt blocks
        this step completes that the tier does not hold."""
        meta = OffloadMetadata(loads=self._loads)
        self._loads = []
        if self.kv_transfer_config.is_kv_producer:
            meta.saves = self.prefix_blocks.saves(self.prefix_blocks.scheduled(scheduler_output))
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Applies the tier's stored / evicted names; blocks that failed to load are to be saved again."""
        changes = connector_output.kv_connector_stats
        if changes:
            self.held.update(changes.get("stored", ()))
            self.held.difference_update(changes.get("evicted", ()))
        self.prefix_blocks.rewind(connector_output.invalid_block_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are copied within their step, so the blocks are free to go at once."""
        self.prefix_blocks.forget(request)
        return False, None

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None, "register_kv_caches on a scheduler-role connector"
        self.worker.register(kv_caches)

    def start_load_kv(self, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load(OffloadMetadata.bound(self._metadata).loads)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.save_layer(layer_name, kv_layer, OffloadMetadata.bound(self._metadata).saves)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.finish_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, (self.worker.loads.take_finished() if self.worker is not None else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.loads.take_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        return self.worker.take_changes() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
