"""The worker half of the ``shared-storage`` connector: block files in and out of the paged KV cache.

Loads: ``start_load`` reads and verifies every file of the step (a bad file stops that request's load there; the
blocks not loaded are reported as load errors), then ``load_layer`` copies one layer into the cache just before
that layer's attention reads it. Saves: ``save_layer`` copies one layer's blocks to the CPU right after the layer
wrote this step's KV, and ``finish_saves`` writes one file per block once every layer is in.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from vllite.plugins.kv_connectors.block_files import SUFFIX, is_complete, read_block, write_block
from vllite.plugins.kv_connectors.errors import KVBlockFileError
from vllite.plugins.kv_connectors.transfers import BlockTransfer, PendingSave

logger = logging.getLogger(__name__)


class SharedStorageWorker:
    """Copies blocks between the registered KV tensors and the block files under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.layers: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self.block_shape: tuple[int, ...] = ()
        self.dtype: torch.dtype | None = None
        self._loads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (block ids, [n, layers, 2, bs, heads, dim])
        self._layers_loaded: set[int] = set()
        self._saves: list[PendingSave] = []
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()  # requests whose load failed this step: nothing of theirs is saved
        self.num_blocks_loaded = 0
        self.num_blocks_saved = 0
        self.num_load_errors = 0

    def path(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Layer name -> ``[2, num_blocks, block_size, heads, dim]``; the dict's order is the layer order."""
        self.layers = list(kv_caches.values())
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        first = self.layers[0]
        self.block_shape = (len(self.layers), 2, *first.shape[2:])
        self.dtype = first.dtype

    # ------------------------------------------------------------------ loads
    def start_load(self, loads: list[BlockTransfer]) -> None:
        """Reads and verifies this step's files; the copies into the cache happen per layer in ``load_layer``."""
        self._loads = []
        self._layers_loaded = set()
        self._failed_reqs = set()
        if not loads:
            return
        assert self.dtype is not None, "register_kv_caches() must come before the first load"
        device = self.layers[0].device
        for transfer in loads:
            blocks: list[torch.Tensor] = []
            for name in transfer.names:
                try:
                    blocks.append(read_block(self.path(name), self.block_shape, self.dtype))
                except KVBlockFileError as exc:
                    failed = transfer.block_ids[len(blocks) :]
                    logger.warning(
                        "shared-storage: %d block(s) of request %s not loaded: %s", len(failed), transfer.req_id, exc
                    )
                    self._load_errors.update(failed)
                    self._failed_reqs.add(transfer.req_id)
                    self.num_load_errors += len(failed)
                    self._discard(name)
                    break
            if blocks:
                ids = torch.tensor(transfer.block_ids[: len(blocks)], dtype=torch.int64, device=device)
                self._loads.append((ids, torch.stack(blocks).to(device)))
                self.num_blocks_loaded += len(blocks)

    def _discard(self, name: str) -> None:
        """Removes a bad file so later lookups miss (and a later save replaces it); best effort."""
        try:
            self.path(name).unlink()
        except OSError:
            pass

    def load_layer(self, layer_name: str) -> None:
        """Copies this step's loaded blocks of one layer into the cache (once per layer and step)."""
        index = self.layer_index.get(layer_name)
        if index is None or index in self._layers_loaded or not self._loads:
            return
        self._layers_loaded.add(index)
        layer = self.layers[index]
        for ids, kv in self._loads:
            layer.index_copy_(1, ids, kv[:, index].transpose(0, 1).to(layer.dtype))

    def finish_loads(self) -> None:
        """Copies whatever layer the forward pass did not ask for (e.g. no forward ran) and forgets the step."""
        if self._loads:
            for name in self.layer_index:
                self.load_layer(name)
        self._loads = []
        self._layers_loaded = set()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ saves
    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, saves: list[BlockTransfer]) -> None:
        """Copies one layer's blocks of this step's saves to the CPU (the layer wrote its KV already)."""
        index = self.layer_index.get(layer_name)
        if index is None or not saves:
            return
        if not self._saves:
            # KV computed on top of a failed load is wrong: it must never reach the store.
            kept = [t for t in saves if t.req_id not in self._failed_reqs]
            self._saves = [PendingSave(t, [None] * len(self.layers)) for t in kept]
        for pending in self._saves:
            ids = torch.tensor(pending.transfer.block_ids, dtype=torch.int64, device=kv_layer.device)
            pending.layers[index] = kv_layer.index_select(1, ids).to("cpu")

    def finish_saves(self) -> None:
        """Writes one file per saved block (every layer must have been captured) and forgets the step."""
        pending, self._saves = self._saves, []
        self._failed_reqs = set()
        for save in pending:
            layers = save.layers
            if any(layer is None for layer in layers):
                logger.warning("shared-storage: not every layer of %s was captured; not saved", save.transfer.req_id)
                continue
            stacked = torch.stack([layer for layer in layers if layer is not None])  # [layers, 2, n, bs, h, d]
            self.directory.mkdir(parents=True, exist_ok=True)
            for j, name in enumerate(save.transfer.names):
                path = self.path(name)
                if is_complete(path):  # another engine (or an earlier step) stored it already
                    continue
                write_block(path, stacked[:, :, j])
                self.num_blocks_saved += 1
