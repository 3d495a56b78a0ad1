"""The worker half of the ``offload`` connector: a bounded LRU of KV blocks in host memory, and optionally a
second, bigger one on disk (:class:`~vllite.plugins.kv_connectors.offload_disk.DiskTier`) that takes what memory evicts.

Saves: ``save_layer`` copies one layer's blocks to the CPU right after the layer wrote this step's KV;
``finish_saves`` puts one ``[num_layers, 2, block_size, heads, dim]`` tensor per block into the tier (evicting the
least recently used blocks beyond ``capacity_bytes``). Loads are asynchronous: ``start_load`` takes this step's
tensors out of the tier (a load holds its own references, so a later eviction cannot pull them away) and hands the
copies into the paged cache to a background thread; ``loads.take_finished`` reports the requests whose copies are
done.
The blocks being loaded belong to requests parked in ``WAITING_FOR_REMOTE_KVS``: no forward pass reads or writes
them until the load is reported, so the thread needs no other synchronisation with the model.

A load finds each block in memory, else on disk (read on the disk tier's I/O thread, checked, then copied in by the
copy thread); a block found in neither, or a disk file that fails its checks, ends the request's load there.
What the tier stored and evicted (from both layers) since the last report goes to the scheduler role as values
(``take_changes``), through ``KVConnectorOutput.kv_connector_stats``: the roles share no object.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from vllite.plugins.kv_connectors.background_loads import BackgroundLoads
from vllite.plugins.kv_connectors.transfers import BlockTransfer, PendingSave

if TYPE_CHECKING:
    from vllite.plugins.kv_connectors.offload_disk import DiskTier

logger = logging.getLogger(__name__)


class OffloadWorker:
    """The host-memory tier (and the disk layer below it, if any) and the copies between them and the registered
    KV tensors."""

    def __init__(self, capacity_bytes: int, disk: DiskTier | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.disk = disk
        self.layers: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self.tier: OrderedDict[str, torch.Tensor] = OrderedDict()  # name -> block, least recently used first
        self.bytes_used = 0
        self._saves: list[PendingSave] = []
        # Since the last take_changes; a name is in at most one of them (its latest change).
        self._stored: dict[str, None] = {}
        self._evicted: dict[str, None] = {}
        self.loads = BackgroundLoads(max_workers=1, thread_name_prefix="vllite-kv-offload")  # the copy thread
        self.num_blocks_saved = 0
        self.num_blocks_evicted = 0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Layer name -> ``[2, num_blocks, block_size, heads, dim]``; the dict's order is the layer order."""
        self.layers = list(kv_caches.values())
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}

    # ------------------------------------------------------------------ loads
    def start_load(self, loads: list[BlockTransfer]) -> None:
        """Takes this step's blocks out of the tier and starts copying them into the cache in the background.
        A block the tier no longer holds ends that request's load there; the rest of its blocks are load errors."""
        for transfer in loads:
            blocks: list[torch.Tensor | Future[torch.Tensor | None]] = []
            for name in transfer.names:
                block = self.tier.get(name)
                if block is not None:
                    self.tier.move_to_end(name)
                    blocks.append(block)
                elif self.disk is not None and name in self.disk:
                    self.disk.touch(name)
                    blocks.append(self.disk.read(name, self._block_shape(), self.layers[0].dtype))
                else:
                    break
            failed = set(transfer.block_ids[len(blocks) :])
            if failed:
                logger.warning(
                    "offload: %d block(s) of request %s are gone from the tier", len(failed), transfer.req_id
                )
            ids = transfer.block_ids[: len(blocks)]
            self.loads.submit(self._copy_in, transfer.req_id, ids, blocks, failed)

    def _block_shape(self) -> tuple[int, ...]:
        """One block of every layer: ``[num_layers, 2, block_size, heads, dim]``."""
        layer = self.layers[0]
        return (len(self.layers), 2, *layer.shape[2:])

    def _copy_in(
        self,
        req_id: str,
        block_ids: list[int],
        pending: list[torch.Tensor | Future[torch.Tensor | None]],
        failed: set[int],
    ) -> None:
        """The copy thread: every layer of the blocks (waiting for those read from disk; one that failed its
        checks ends the load there) into ``block_ids``, then the request is reported done."""
        blocks: list[torch.Tensor] = []
        try:
            for item in pending:
                block = item.result() if isinstance(item, Future) else item
                if block is None:
                    break
                blocks.append(block)
            failed = failed | set(block_ids[len(blocks) :])
            block_ids = block_ids[: len(blocks)]
            if blocks:
                device = self.layers[0].device
                ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
                kv = torch.stack(blocks).to(device)  # [n, layers, 2, bs, heads, dim]
                for index, layer in enumerate(self.layers):
                    layer.index_copy_(1, ids, kv[:, index].transpose(0, 1).to(layer.dtype))
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
        except Exception:  # a failed copy is a load error, never a hang
            logger.exception("offload: loading request %s failed", req_id)
            failed = failed | set(block_ids)
            blocks = []
        self.loads.finish(req_id, len(blocks), failed)

    # ------------------------------------------------------------------ saves
    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, saves: list[BlockTransfer]) -> None:
        """Copies one layer's blocks of this step's saves to the CPU (the layer wrote its KV already)."""
        index = self.layer_index.get(layer_name)
        if index is None or not saves:
            return
        if not self._saves:
            self._saves = [PendingSave(t, [None] * len(self.layers)) for t in saves]
        for pending in self._saves:
            ids = torch.tensor(pending.transfer.block_ids, dtype=torch.int64, device=kv_layer.device)
            pending.layers[index] = kv_layer.index_select(1, ids).to("cpu")

    def finish_saves(self) -> None:
        """Puts the captured blocks into the tier (every layer must have been captured) and evicts beyond the
        bound; a block larger than the whole memory layer goes to disk, or is not kept without one."""
        pending, self._saves = self._saves, []
        for save in pending:
            if any(layer is None for layer in save.layers):
                logger.warning("offload: not every layer of %s was captured; not stored", save.transfer.req_id)
                continue
            stacked = torch.stack([layer for layer in save.layers if layer is not None])  # [layers, 2, n, bs, h, d]
            for j, name in enumerate(save.transfer.names):
                if name in self.tier:
                    self.tier.move_to_end(name)
                    continue
                if self.disk is not None and name in self.disk:
                    self.disk.touch(name)
                    continue
                block = stacked[:, :, j].clone()
                size = block.numel() * block.element_size()
                if size > self.capacity_bytes and self.disk is None:
                    continue
                self._evicted.pop(name, None)
                self._stored[name] = None
                self.num_blocks_saved += 1
                if size > self.capacity_bytes:  # too big for memory: straight to disk
                    for gone in self.disk.put(name, block) if self.disk is not None else ():
                        self._forget(gone)
                    continue
                self.tier[name] = block
                self.bytes_used += size
                self._evict()

    def _evict(self) -> None:
        """Least recently used blocks beyond the bound leave memory: to the disk layer if there is one (which may
        evict in turn), else out of the tier."""
        while self.bytes_used > self.capacity_bytes and self.tier:
            name, block = self.tier.popitem(last=False)
            self.bytes_used -= block.numel() * block.element_size()
            for gone in self.disk.put(name, block) if self.disk is not None else [name]:
                self._forget(gone)

    def _forget(self, name: str) -> None:
        self._stored.pop(name, None)
        self._evicted[name] = None
        self.num_blocks_evicted += 1

    def take_changes(self) -> dict[str, list[str]] | None:
        """``{"stored": [...], "evicted": [...]}``: block names whose latest change since the previous call was
        being stored / evicted, or ``None``."""
        if self.disk is not None:
            for name in self.disk.take_bad():
                self._forget(name)
        if not (self._stored or self._evicted):
            return None
        changes = {"stored": list(self._stored), "evicted": list(self._evicted)}
        self._stored, self._evicted = {}, {}
        return changes

    def shutdown(self) -> None:
        self.loads.shutdown()
        if self.disk is not None:
            self.disk.close()
        self.tier.clear()
        self.bytes_used = 0
