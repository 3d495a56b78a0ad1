"""``BlockPool``: every physical block, the free queue, and the prefix cache's hash-to-block map.

The pool hands out blocks (empty ones first, then evicting the least recently freed cached block), registers
full blocks under their hashes, revives cached blocks on a hit (``touch``) and takes blocks back
(``free_blocks``). Block 0 is reserved as the null block and never handed out. With KV-cache events on
(``enable_kv_cache_events``), it records what it caches, evicts and clears as ``vllite.kv_events`` events.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from vllite.exceptions import KVCacheStateError
from vllite.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from vllite.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from vllite.request import Request

logger = logging.getLogger(__name__)


class BlockHashToBlockMap:
    """Hash → the cached blocks holding it. Usually one block per hash; two requests that filled blocks with the
    same content independently (a request's own blocks are never swapped for cached ones) give several.

    A single block is stored bare and only a repeated hash pays for an inner dict.
    """

    def __init__(self) -> None:
        self._map: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self._num_blocks = 0

    def get_one_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """Any one block holding ``block_hash``, or ``None``."""
        entry = self._map.get(block_hash)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def insert(self, block_hash: bytes, block: KVCacheBlock) -> None:
        """Registers ``block`` under ``block_hash``."""
        entry = self._map.get(block_hash)
        if entry is None:
            self._map[block_hash] = block
        elif isinstance(entry, KVCacheBlock):
            self._map[block_hash] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block
        self._num_blocks += 1

    def pop(self, block_hash: bytes, block_id: int) -> KVCacheBlock | None:
        """Unregisters block ``block_id`` from ``block_hash``; returns it, or ``None`` if it was not there."""
        entry = self._map.get(block_hash)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id != block_id:
                return None
            del self._map[block_hash]
            self._num_blocks -= 1
            return entry
        block = entry.pop(block_id, None)
        if block is None:
            return None
        if len(entry) == 1:
            self._map[block_hash] = next(iter(entry.values()))
        self._num_blocks -= 1
        return block

    def blocks(self) -> Iterator[tuple[bytes, KVCacheBlock]]:
        """Every ``(hash, block)`` pair (for checks and stats, not the hot path)."""
        for block_hash, entry in self._map.items():
            if isinstance(entry, KVCacheBlock):
                yield block_hash, entry
            else:
                for block in entry.values():
                    yield block_hash, block

    def __len__(self) -> int:
        """The number of cached blocks (not of distinct hashes)."""
        return self._num_blocks

    def num_hashes(self) -> int:
        """The number of distinct hashes."""
        return len(self._map)


class BlockPool:
    """All ``num_blocks`` blocks of one KV cache. Block 0 is the null block.

    Promises: a block is in the free queue exactly when its ``ref_cnt`` is 0 (the null block is never queued);
    a block holds a hash exactly when the map lists it under that hash; a freed block keeps its hash (it stays
    an eviction candidate) until ``get_new_blocks`` reuses it or the cache is reset.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"A block pool needs at least the null block; got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] | None = None  # None: events off
        self.event_block_size = 0

    # ------------------------------------------------------------------ KV-cache events
    def enable_kv_cache_events(self, block_size: int) -> None:
        """Starts recording ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events (``take_events``)."""
        self.event_block_size = block_size
        if self.kv_event_queue is None:
            self.kv_event_queue = []

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the previous call, oldest first (empty when events are off)."""
        events = self.kv_event_queue
        if not events:
            return []
        self.kv_event_queue = []
        return events

    # ------------------------------------------------------------------ queries
    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now: empty ones and evictable cached ones."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """The fraction of usable (non-null) blocks in use, in [0, 1]."""
        usable = self.num_blocks - 1
        if usable <= 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / usable

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash, in use or evictable."""
        return len(self.cached_block_hash_to_block)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """A block caching ``block_hash``, or ``None`` on a miss. Does not take a reference (see ``touch``)."""
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    # ------------------------------------------------------------------ allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` blocks from the free queue's head, each with ``ref_cnt == 1``.

        A cached block taken this way is evicted: its hash is dropped from the block and the map.
        Raises ``ValueError`` when fewer blocks are free.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on each block (a prefix-cache hit), pulling evictable ones out of the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference on each block. Blocks reaching zero that hold no hash join the free queue's head
        (reused first: they hold nothing worth keeping); cached ones join its tail in the given order, keeping
        their hashes. Pass a request's blocks reversed so that its tail is evicted before its prefix.
        """
        uncached: list[KVCacheBlock] = []
        cached: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (cached if block.block_hash is not None else uncached).append(block)
        self.free_block_queue.appendleft_n(uncached)
        self.free_block_queue.append_n(cached)

    # ------------------------------------------------------------------ caching
    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_hashes: Sequence[bytes] | None = None,
    ) -> None:
        """Registers ``blocks[num_cached_blocks:num_full_blocks]`` under ``block_hashes`` (default
        ``request.block_hashes``; a KV-cache group other than the first passes its own namespaced view) at the same
        positions, and reports them under those hashes in the KV events. Null blocks (slots outside a sliding
        window) are skipped.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        if block_hashes is None:
            block_hashes = request.block_hashes
        if len(block_hashes) < num_full_blocks:
            raise KVCacheStateError(
                f"Request {request.request_id!r} has {len(block_hashes)} block hashes but {num_full_blocks} "
                "full blocks to cache; build it with block_hasher=get_request_block_hasher(...)."
            )
        cache_map = self.cached_block_hash_to_block
        stored: list[int] | None = [] if self.kv_event_queue is not None else None
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            if block.block_hash is not None:
                # Shared with another request that re-registered it first (after a failed KV load, see
                # KVCacheManager.evict_blocks): the same position of the same chain, so the same hash.
                assert block.block_hash == block_hashes[i], f"{block} is already cached under another hash"
                continue
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            cache_map.insert(block_hash, block)
            if stored is not None:
                stored.append(i)
        if stored:
            self._record_stored(request, stored, block_hashes)

    def _record_stored(self, request: Request, positions: list[int], hashes: Sequence[bytes]) -> None:
        """One ``BlockStored`` per run of consecutive newly cached block positions of ``request``."""
        assert self.kv_event_queue is not None
        size = self.event_block_size
        lora = request.lora_request
        start = 0
        for end in range(1, len(positions) + 1):
            if end < len(positions) and positions[end] == positions[end - 1] + 1:
                continue
            first, last = positions[start], positions[end - 1]
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=list(hashes[first : last + 1]),
                    parent_block_hash=hashes[first - 1] if first > 0 else None,
                    token_ids=list(request.all_token_ids[first * size : (last + 1) * size]),
                    block_size=size,
                    lora_id=lora.lora_int_id if lora is not None else None,
                    lora_name=lora.lora_name if lora is not None else None,
                )
            )
            start = end

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached hash (e.g. after a weight update); returns whether it did.

        Refuses (returns False) while any block other than the null block is in use, unless
        ``reset_running_requests``: then blocks in use lose their hashes too, so they are never shared again.
        """
        num_used = self.num_blocks - 1 - self.free_block_queue.num_free_blocks
        if num_used > 0 and not reset_running_requests:
            logger.warning(
                "Failed to reset the prefix cache: %d blocks are still in use (finish or preempt the running "
                "requests first, or reset with reset_running_requests=True).",
                num_used,
            )
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        if self.kv_event_queue is not None:
            self.kv_event_queue.append(AllBlocksCleared())
        logger.info("Prefix cache reset.")
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drops the hashes of the given blocks (in use or free): their content is wrong (a failed KV load), so
        no prefix-cache lookup may find them. Blocks without a hash are left alone."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        popped = self.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
        assert popped is block, f"{block} holds a hash the map does not list it under"
        if self.kv_event_queue is not None and self.cached_block_hash_to_block.get_one_block(block.block_hash) is None:
            # The last block holding this hash: it no longer hits (another copy would still).
            self.kv_event_queue.append(BlockRemoved(block_hashes=[block.block_hash]))
        block.reset_hash()
