"""``offload``: a bounded second KV tier in host memory, keyed by block hash; a prefix cache larger than the KV cache.

``--kv-offload-size GiB`` (without ``--kv-transfer-config``), or ``--kv-transfer-config '{"kv_connector":
"offload", "kv_connector_extra_config": {"offload_size_gib": 4}}'`` (1 GiB when not given).

With ``"offload_dir": PATH`` the tier gets a second layer on disk, bounded by ``offload_disk_size_gib`` (default
4): blocks memory evicts are written there (checksummed files in a private folder, removed at shutdown) and loaded
back from there, so the tier can be far larger than host memory (:mod:`vllite.kv_connector.offload_disk`).

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
``kv_load_failure_policy``). Worker role: :mod:`vllite.kv_connector.offload_worker`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllite.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole
from vllite.kv_connector.shared_storage import NULL_BLOCK_ID, prefix_block_names, rewind_saves

if TYPE_CHECKING:
    import torch

    from vllite.config import EngineConfig
    from vllite.kv_connector.config import KVTransferConfig
    from vllite.kv_connector.offload_worker import BlockTransfer, OffloadWorker
    from vllite.request import Request
    from vllite.sched.output import SchedulerOutput

#: ``offload_size_gib`` when the extra config does not say.
DEFAULT_OFFLOAD_SIZE_GIB = 1.0
#: ``offload_disk_size_gib`` when ``offload_dir`` is given and the extra config does not say.
DEFAULT_OFFLOAD_DISK_SIZE_GIB = 4.0


def _transfer(req_id: str, block_ids: list[int], names: list[str]) -> BlockTransfer:
    """The (block, name) pairs of ``block_ids``/``names`` that are not the null block."""
    from vllite.kv_connector.offload_worker import BlockTransfer

    pairs = [(b, n) for b, n in zip(block_ids, names) if b != NULL_BLOCK_ID]
    return BlockTransfer(req_id, [b for b, _ in pairs], [n for _, n in pairs])


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
class OffloadMetadata(KVConnectorMetadata):
    """One step's work for the worker: blocks to load from the tier, blocks to copy to it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """What the scheduler role knows about one live request."""

    request: Request
    names: list[str]  # name of each full prompt block, in order
    block_ids: list[int] = field(default_factory=list)
    local_tokens: int = 0  # the local prefix hit at the last lookup
    saved_blocks: int = 0  # blocks [0, saved_blocks) were sent to the tier or loaded from it


class OffloadConnector(KVConnectorBase):
    """Both roles of the ``offload`` connector (registered under that name by the builtin plugin)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        super().__init__(config, role, kv_transfer_config)
        self.capacity_bytes = offload_capacity_bytes(kv_transfer_config)
        disk = offload_disk(kv_transfer_config)
        self.block_size = config.cache_config.block_size
        self._seed = hashlib.sha256(b"vllite.offload").digest()
        self._tracked: dict[str, _Tracked] = {}
        self.held: set[str] = set()  # names the tier holds, as the worker last reported (scheduler role)
        self._loads: list[BlockTransfer] = []  # set up since the last build_connector_meta
        self.num_loads = 0  # asynchronous loads set up (scheduler role)
        self.num_loaded_tokens = 0
        self.worker: OffloadWorker | None = None
        if role == KVConnectorRole.WORKER:
            from vllite.kv_connector.offload_disk import DiskTier
            from vllite.kv_connector.offload_worker import OffloadWorker

            self.worker = OffloadWorker(self.capacity_bytes, DiskTier(*disk) if disk is not None else None)

    # ------------------------------------------------------------------ scheduler role
    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.request is not request:
            names = prefix_block_names(request, self.block_size, self._seed)
            tracked = self._tracked[request.request_id] = _Tracked(request, names)
        return tracked

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prefix the tier holds beyond ``num_computed_tokens``, excluding the prompt's last token; async."""
        tracked = self._track(request)
        tracked.local_tokens = num_computed_tokens
        if not self.kv_transfer_config.is_kv_consumer or not self.held:
            return 0, False
        loadable = (request.num_prompt_tokens - 1) // self.block_size
        block = num_computed_tokens // self.block_size
        while block < loadable and tracked.names[block] in self.held:
            block += 1
        num = max(0, block * self.block_size - num_computed_tokens)
        return num, num > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        tracked = self._track(request)
        tracked.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            return
        start = tracked.local_tokens // self.block_size
        end = (tracked.local_tokens + num_external_tokens) // self.block_size
        self._loads.append(_transfer(request.request_id, tracked.block_ids[start:end], tracked.names[start:end]))
        tracked.saved_blocks = max(tracked.saved_blocks, end)
        self.num_loads += 1
        self.num_loaded_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = OffloadMetadata(loads=self._loads)
        self._loads = []
        if not self.kv_transfer_config.is_kv_producer:
            return meta
        scheduled: list[tuple[str, int]] = []  # (request id, num computed tokens before this step)
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids)
            scheduled.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            new_blocks = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if tracked is not None and new_blocks:
                tracked.block_ids.extend(new_blocks)
            scheduled.append((req_id, cached.num_computed_tokens[i]))
        for req_id, num_computed in scheduled:
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                self._add_saves(meta, tracked, num_computed, scheduler_output.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _add_saves(self, meta: OffloadMetadata, tracked: _Tracked, num_computed: int, num_new: int) -> None:
        """The full prompt blocks this step completes that the tier does not hold."""
        end = min(num_computed + num_new, tracked.request.num_prompt_tokens) // self.block_size
        start = max(tracked.saved_blocks, num_computed // self.block_size)
        if end <= start:
            return
        tracked.saved_blocks = end
        todo = [b for b in range(start, min(end, len(tracked.block_ids))) if tracked.names[b] not in self.held]
        if todo:
            ids = [tracked.block_ids[b] for b in todo]
            meta.saves.append(_transfer(tracked.request.request_id, ids, [tracked.names[b] for b in todo]))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Applies the tier's stored / evicted names; blocks that failed to load are to be saved again."""
        changes = connector_output.kv_connector_stats
        if changes:
            self.held.update(changes.get("stored", ()))
            self.held.difference_update(changes.get("evicted", ()))
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        rewind_saves(self._tracked.values(), invalid)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are copied within their step, so the blocks are free to go at once."""
        self._tracked.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker role
    def _worker_meta(self) -> OffloadMetadata:
        meta = self._metadata
        return meta if isinstance(meta, OffloadMetadata) else OffloadMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None, "register_kv_caches on a scheduler-role connector"
        self.worker.register(kv_caches)

    def start_load_kv(self, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load(self._worker_meta().loads)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.save_layer(layer_name, kv_layer, self._worker_meta().saves)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.finish_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, (self.worker.take_finished() if self.worker is not None else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        return self.worker.take_changes() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
