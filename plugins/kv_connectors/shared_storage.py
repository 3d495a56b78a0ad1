"""``shared-storage``: prompt-prefix KV persisted to a directory, reused by a restarted or a second engine.

``--kv-transfer-config '{"kv_connector": "shared-storage", "kv_role": "kv_both",
"kv_connector_extra_config": {"shared_storage_path": "/some/dir"}}'``

Every full prompt block is one safetensors file (:mod:`vllite.plugins.kv_connectors.block_files`) named by the SHA-256
hash chain of the prefix that ends with it (token ids, plus the LoRA adapter and cache salt as the prefix cache
hashes them), in a subdirectory per model (its resolved path, dtype and block size; ``namespace`` in the extra
config overrides it, e.g. to share one directory between copies of a model).

Scheduler role: ``get_num_new_matched_tokens`` is the longest stored block-aligned prefix (never the whole
prompt: its last token is always computed) beyond the local hit, loaded synchronously; the step's
``SharedStorageMetadata`` lists the blocks to load and the newly computed full prompt blocks to save (for
``kv_producer`` / ``kv_both``). Worker role: see :mod:`vllite.plugins.kv_connectors.shared_storage_worker`. A truncated
file is a miss for the scheduler; a file that fails its checksum when loaded is reported through
``get_block_ids_with_load_errors`` (and removed), so the engine recomputes or fails per
``kv_load_failure_policy``. The per-request bookkeeping (block names, loads, saves) is a
:class:`~vllite.plugins.kv_connectors.prefix_blocks.PrefixBlockTracker` asking ``_stored`` (the files).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllite.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole
from vllite.plugins.kv_connectors.block_files import SUFFIX, is_complete

# The ``name as name`` imports re-export what lived here before prefix_blocks: still importable from here.
from vllite.plugins.kv_connectors.prefix_blocks import NULL_BLOCK_ID as NULL_BLOCK_ID
from vllite.plugins.kv_connectors.prefix_blocks import PrefixBlockTracker
from vllite.plugins.kv_connectors.prefix_blocks import prefix_block_names as prefix_block_names
from vllite.plugins.kv_connectors.prefix_blocks import rewind_saves as rewind_saves
from vllite.plugins.kv_connectors.transfers import BlockTransferMetadata

if TYPE_CHECKING:
    import torch

    from vllite.config import EngineConfig
    from vllite.kv_connector.config import KVTransferConfig
    from vllite.plugins.kv_connectors.shared_storage_worker import SharedStorageWorker
    from vllite.request import Request
    from vllite.sched.output import SchedulerOutput


@dataclass
class SharedStorageMetadata(BlockTransferMetadata):
    """One step's work for the worker: blocks to load from files, blocks to save to files."""


def storage_directory(config: EngineConfig, kv_transfer_config: KVTransferConfig) -> Path:
    """``shared_storage_path`` / the model's namespace (see the module docstring)."""
    root = kv_transfer_config.get_from_extra_config("shared_storage_path")
    if not root or not isinstance(root, str):
        raise ValueError(
            "kv_transfer_config.kv_connector_extra_config.shared_storage_path must name a directory "
            "for the shared-storage connector."
        )
    namespace = kv_transfer_config.get_from_extra_config("namespace")
    if not namespace:
        mc, cc = config.model_config, config.cache_config
        model = os.path.realpath(mc.model) if mc.model and os.path.exists(mc.model) else str(mc.model)
        key = f"{model}|{mc.dtype}|{cc.kv_cache_dtype}|{cc.block_size}"
        namespace = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(root) / str(namespace)


class SharedStorageConnector(KVConnectorBase):
    """Both roles of the ``shared-storage`` connector (registered under that name by the builtin plugin)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        super().__init__(config, role, kv_transfer_config)
        self.directory = storage_directory(config, kv_transfer_config)
        self.block_size = config.cache_config.block_size
        seed = hashlib.sha256(f"vllite.shared-storage|{self.directory.name}".encode()).digest()
        self.prefix_blocks = PrefixBlockTracker(self.block_size, seed, self._stored)
        self._complete: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) of a file found complete
        self.num_matched_tokens = 0  # external tokens promised to admitted requests (scheduler role)
        self.worker: SharedStorageWorker | None = None
        if role == KVConnectorRole.WORKER:
            from vllite.plugins.kv_connectors.shared_storage_worker import SharedStorageWorker

            self.worker = SharedStorageWorker(self.directory)

    # ------------------------------------------------------------------ scheduler role
    def _stored(self, name: str) -> bool:
        """Whether the file of ``name`` exists and is complete (cached per size and modification time)."""
        path = self.directory / f"{name}{SUFFIX}"
        try:
            st = path.stat()
        except OSError:
            self._complete.pop(name, None)
            return False
        stamp = (st.st_size, st.st_mtime_ns)
        if self._complete.get(name) == stamp:
            return True
        if not is_complete(path):
            return False
        self._complete[name] = stamp
        return True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The stored block-aligned prefix beyond ``num_computed_tokens``, excluding the prompt's last token."""
        consumer = self.kv_transfer_config.is_kv_consumer
        return self.prefix_blocks.matched_tokens(request, num_computed_tokens, consumer), False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The external blocks are loaded when the request is next scheduled (``build_connector_meta``)."""
        self.prefix_blocks.allocated(request, block_ids, num_external_tokens)
        if num_external_tokens > 0:
            self.num_matched_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The scheduled requests' pending loads, and (for ``kv_producer`` / ``kv_both``) the full prompt blocks
        this step completes that are not stored yet."""
        scheduled = self.prefix_blocks.scheduled(scheduler_output)
        loads = [load for step in scheduled if (load := self.prefix_blocks.take_load(step.tracked)) is not None]
        saves = self.prefix_blocks.saves(scheduled) if self.kv_transfer_config.is_kv_producer else []
        return SharedStorageMetadata(loads, saves)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks that failed to load are recomputed: they (and what follows) are to be saved again."""
        self.prefix_blocks.rewind(connector_output.invalid_block_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves finish within their step, so the blocks are free to go at once."""
        self.prefix_blocks.forget(request)
        return False, None

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None, "register_kv_caches on a scheduler-role connector"
        self.worker.register(kv_caches)

    def start_load_kv(self, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load(SharedStorageMetadata.bound(self._metadata).loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.load_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.save_layer(layer_name, kv_layer, SharedStorageMetadata.bound(self._metadata).saves)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.finish_loads()
            self.worker.finish_saves()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()
