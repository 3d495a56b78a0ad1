"""``shared-storage``: prompt-prefix KV persisted to a directory, reused by a restarted or a second engine.

``--kv-transfer-config '{"kv_connector": "shared-storage", "kv_role": "kv_both",
"kv_connector_extra_config": {"shared_storage_path": "/some/dir"}}'``

Every full prompt block is one safetensors file (:mod:`vllite.kv_connector.block_files`) named by the SHA-256
hash chain of the prefix that ends with it (token ids, plus the LoRA adapter and cache salt as the prefix cache
hashes them), in a subdirectory per model (its resolved path, dtype and block size; ``namespace`` in the extra
config overrides it, e.g. to share one directory between copies of a model).

Scheduler role: ``get_num_new_matched_tokens`` is the longest stored block-aligned prefix (never the whole
prompt: its last token is always computed) beyond the local hit, loaded synchronously; the step's
``SharedStorageMetadata`` lists the blocks to load and the newly computed full prompt blocks to save (for
``kv_producer`` / ``kv_both``). Worker role: see :mod:`vllite.kv_connector.shared_storage_worker`. A truncated
file is a miss for the scheduler; a file that fails its checksum when loaded is reported through
``get_block_ids_with_load_errors`` (and removed), so the engine recomputes or fails per
``kv_load_failure_policy``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllite.kv_cache.hashing import generate_block_hash_extra_keys, hash_block_tokens, sha256_hash
from vllite.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole
from vllite.kv_connector.block_files import SUFFIX, is_complete

if TYPE_CHECKING:
    import torch

    from vllite.config import EngineConfig
    from vllite.kv_connector.config import KVTransferConfig
    from vllite.kv_connector.shared_storage_worker import BlockTransfer, SharedStorageWorker
    from vllite.request import Request
    from vllite.sched.output import SchedulerOutput


#: The paged cache's null block (blocks a sliding window dropped point at it): never loaded into or saved.
NULL_BLOCK_ID = 0


def _transfer(req_id: str, block_ids: list[int], names: list[str]) -> BlockTransfer:
    """The (block, file) pairs of ``block_ids``/``names`` that are not the null block."""
    from vllite.kv_connector.shared_storage_worker import BlockTransfer

    pairs = [(b, n) for b, n in zip(block_ids, names) if b != NULL_BLOCK_ID]
    return BlockTransfer(req_id, [b for b, _ in pairs], [n for _, n in pairs])


def rewind_saves(tracked: Iterable[Any], invalid: set[int]) -> None:
    """Blocks that failed to load are recomputed: each request's saves restart at its first such block
    (``tracked`` items have ``block_ids`` and ``saved_blocks``; shared by the block-saving connectors)."""
    for entry in tracked:
        first = next((i for i, b in enumerate(entry.block_ids) if b in invalid), None)
        if first is not None:
            entry.saved_blocks = min(entry.saved_blocks, first)


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    """One step's work for the worker: blocks to load from files, blocks to save to files."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """What the scheduler role knows about one live request."""

    request: Request
    names: list[str]  # file name of each full prompt block, in order
    block_ids: list[int] = field(default_factory=list)
    local_tokens: int = 0  # the local prefix hit at the last lookup
    load: tuple[int, int] | None = None  # blocks [start, end) to load in the next step
    saved_blocks: int = 0  # blocks [0, saved_blocks) were saved or found stored


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


def prefix_block_names(request: Request, block_size: int, seed: bytes) -> list[str]:
    """The file name of every full prompt block of ``request``: the hex hash chain of its prefixes."""
    tokens = request.prompt_token_ids
    names: list[str] = []
    parent = seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = generate_block_hash_extra_keys(request, start)
        parent = hash_block_tokens(sha256_hash, parent, tokens[start : start + block_size], extra)
        names.append(parent.hex())
    return names


class SharedStorageConnector(KVConnectorBase):
    """Both roles of the ``shared-storage`` connector (registered under that name by the builtin plugin)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        super().__init__(config, role, kv_transfer_config)
        self.directory = storage_directory(config, kv_transfer_config)
        self.block_size = config.cache_config.block_size
        self._seed = hashlib.sha256(f"vllite.shared-storage|{self.directory.name}".encode()).digest()
        self._tracked: dict[str, _Tracked] = {}
        self._complete: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) of a file found complete
        self.num_matched_tokens = 0  # external tokens promised to admitted requests (scheduler role)
        self.worker: SharedStorageWorker | None = None
        if role == KVConnectorRole.WORKER:
            from vllite.kv_connector.shared_storage_worker import SharedStorageWorker

            self.worker = SharedStorageWorker(self.directory)

    # ------------------------------------------------------------------ scheduler role
    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.request is not request:
            names = prefix_block_names(request, self.block_size, self._seed)
            tracked = self._tracked[request.request_id] = _Tracked(request, names)
        return tracked

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
        tracked = self._track(request)
        tracked.local_tokens = num_computed_tokens
        if not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        loadable = (request.num_prompt_tokens - 1) // self.block_size
        block = num_computed_tokens // self.block_size
        while block < loadable and self._stored(tracked.names[block]):
            block += 1
        return max(0, block * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        tracked = self._track(request)
        tracked.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            tracked.load = None
            return
        start = tracked.local_tokens // self.block_size
        end = (tracked.local_tokens + num_external_tokens) // self.block_size
        tracked.load = (start, end)
        tracked.saved_blocks = max(tracked.saved_blocks, end)
        self.num_matched_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SharedStorageMetadata()
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
            if tracked is None:
                continue
            if tracked.load is not None:
                start, end = tracked.load
                tracked.load = None
                meta.loads.append(_transfer(req_id, tracked.block_ids[start:end], tracked.names[start:end]))
            if self.kv_transfer_config.is_kv_producer:
                self._add_saves(meta, tracked, num_computed, scheduler_output.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _add_saves(self, meta: SharedStorageMetadata, tracked: _Tracked, num_computed: int, num_new: int) -> None:
        """The full prompt blocks this step completes that are not stored yet."""
        end = min(num_computed + num_new, tracked.request.num_prompt_tokens) // self.block_size
        start = max(tracked.saved_blocks, num_computed // self.block_size)
        if end <= start:
            return
        tracked.saved_blocks = end
        todo = [b for b in range(start, min(end, len(tracked.block_ids))) if not self._stored(tracked.names[b])]
        if todo:
            ids = [tracked.block_ids[b] for b in todo]
            meta.saves.append(_transfer(tracked.request.request_id, ids, [tracked.names[b] for b in todo]))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks that failed to load are recomputed: they (and what follows) are to be saved again."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        rewind_saves(self._tracked.values(), invalid)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves finish within their step, so the blocks are free to go at once."""
        self._tracked.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker role
    def _worker_meta(self) -> SharedStorageMetadata:
        meta = self._metadata
        return meta if isinstance(meta, SharedStorageMetadata) else SharedStorageMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None, "register_kv_caches on a scheduler-role connector"
        self.worker.register(kv_caches)

    def start_load_kv(self, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load(self._worker_meta().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.load_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.save_layer(layer_name, kv_layer, self._worker_meta().saves)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.finish_loads()
            self.worker.finish_saves()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()
