"""Per-request block tables for one attention type: full attention, or a sliding window.

A request's block list is append-only: a block, once placed at position ``i``, stays there until the request is
freed or its tail is cut off (``free_tail``, for a request no worker holds); a sliding window may also swap blocks
that fell out of the window for the null block. Prefix-cache hits
are attached only when a request is first scheduled; afterwards its own blocks are cached as they fill.

A manager serves one KV-cache group (``group_id``): it looks its blocks up and caches them under the group's keys
(``group_block_hashes``), so several managers can share one ``BlockPool`` (``vllite.kv_cache.hybrid``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllite.kv_cache.block import KVCacheBlock
from vllite.kv_cache.block_pool import BlockPool
from vllite.kv_cache.hashing import group_block_hashes

if TYPE_CHECKING:
    from vllite.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class FullAttentionManager:
    """Block tables for full attention: every block a request ever filled stays attached to it.

    Promises: a request's blocks are cached under group ``group_id``'s keys only; the methods that release
    blocks (``free``, ``free_tail``, ``remove_skipped_blocks``) are the only ones handing blocks back to the pool,
    while ``pop_request`` and ``cut_tail`` detach blocks and leave releasing them to the caller.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int = 0) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # Leading blocks of each request already registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.new_block_ids: list[int] = []

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest cached prefix of at most ``max_length`` tokens. ``block_hashes`` are
        the request's own; the manager looks them up under its group's keys.

        Hashes chain, so the scan stops at the first miss even if later blocks happen to be cached.
        """
        get_cached_block = self.block_pool.get_cached_block
        hits: list[KVCacheBlock] = []
        keys = group_block_hashes(block_hashes, self.group_id)
        for block_hash in keys[: max(0, max_length) // self.block_size]:
            block = get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Releases blocks no future token attends to; full attention needs them all."""

    def num_freed_by_skipping(self, request_id: str, num_computed_tokens: int) -> int:
        """How many blocks ``remove_skipped_blocks`` would return to the free queue (it changes nothing)."""
        return 0

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free-queue blocks needed to give the request ``num_tokens`` slots, counting the evictable hits that
        ``touch`` will pull out of the free queue.
        """
        num_required = cdiv(num_tokens, self.block_size)
        num_held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(0, num_required - len(new_computed_blocks) - num_held)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable_hits

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Attaches already-touched prefix-cache hits; only a request that holds no blocks yet can get them."""
        if request_id not in self.num_cached_block:
            blocks = self.req_to_blocks[request_id]
            assert not blocks, f"request {request_id!r} got prefix-cache hits after its first scheduling"
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        else:
            assert not new_computed_blocks, f"running request {request_id!r} got prefix-cache hits"

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Appends fresh blocks until the request has slots for ``num_tokens`` tokens; returns them."""
        blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        self.new_block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def new_step_starts(self) -> None:
        """Forgets the blocks allocated so far: ``take_new_block_ids`` reports only later ones."""
        self.new_block_ids.clear()

    def take_new_block_ids(self) -> list[int]:
        """The ids of the blocks allocated since ``new_step_starts`` (or the previous take), and forgets them."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the request's blocks that are full within its first ``num_tokens`` tokens."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        keys = group_block_hashes(request.block_hashes, self.group_id)
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[request_id], num_cached, num_full, keys)
        self.num_cached_block[request_id] = num_full

    def uncache_blocks(self, block_ids: set[int]) -> None:
        """Lowers each request's count of cached leading blocks to its first block in ``block_ids`` (whose hashes
        the pool just dropped), so that ``cache_blocks`` registers them again once they are recomputed."""
        for request_id, blocks in self.req_to_blocks.items():
            num_cached = self.num_cached_block.get(request_id, 0)
            first = next((i for i, b in enumerate(blocks[:num_cached]) if b.block_id in block_ids), None)
            if first is not None:
                self.num_cached_block[request_id] = first

    def pop_request(self, request_id: str) -> list[KVCacheBlock]:
        """Forgets the request and returns its blocks, in order, without releasing them (empty when unknown)."""
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, None) or []

    def free(self, request_id: str) -> None:
        """Releases the request's blocks tail first, so its tail is evicted before its reusable prefix."""
        blocks = self.pop_request(request_id)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def num_kept_by_free_tail(self, request_id: str, num_blocks: int) -> int:
        """How many leading blocks ``free_tail(request_id, num_blocks)`` keeps: a prefix whose KV stays valid."""
        blocks = self.req_to_blocks.get(request_id)
        return max(0, len(blocks) - num_blocks) if blocks else 0

    def cut_tail(self, request_id: str, num_kept: int) -> list[KVCacheBlock]:
        """Detaches the request's blocks after its first ``num_kept`` (``>= 1``) and returns them without
        releasing them; the count of cached leading blocks shrinks with the list."""
        blocks = self.req_to_blocks[request_id]
        removed = blocks[num_kept:]
        del blocks[num_kept:]
        if self.num_cached_block.get(request_id, 0) > num_kept:
            self.num_cached_block[request_id] = num_kept
        return removed

    def free_tail(self, request_id: str, num_blocks: int) -> int:
        """Releases the request's last ``num_blocks`` blocks (all of them when it has no more), tail first; returns
        how many it keeps (``num_kept_by_free_tail``)."""
        num_kept = self.num_kept_by_free_tail(request_id, num_blocks)
        if num_kept == 0:
            self.free(request_id)
            return 0
        self.block_pool.free_blocks(reversed(self.cut_tail(request_id, num_kept)))
        return num_kept


class SlidingWindowManager(FullAttentionManager):
    """Block tables for sliding-window attention over ``sliding_window`` tokens.

    Blocks entirely before the window of the next token to compute are released and replaced by the null
    block; a cache hit only needs the blocks that cover the window before the hit's end.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, sliding_window: int, group_id: int = 0) -> None:
        if sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        super().__init__(block_pool, block_size, group_id)
        self.sliding_window = sliding_window

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[KVCacheBlock]:
        """Scans from the right for the last run of cached blocks long enough to cover a window; blocks before
        the run are the null block. Without such a run, only a run at the very start counts.
        """
        null_block = self.block_pool.null_block
        get_cached_block = self.block_pool.get_cached_block
        block_hashes = group_block_hashes(block_hashes, self.group_id)
        max_num_blocks = max(0, min(max_length // self.block_size, len(block_hashes)))
        needed = max(1, cdiv(self.sliding_window - 1, self.block_size))
        hits = [null_block] * max_num_blocks
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = get_cached_block(block_hashes[i])
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= needed:
                del hits[i + run :]
                return hits
        # No run covers a full window: the prefix from position 0 is still a valid hit.
        del hits[run:]
        return hits

    def _skipped_indices(self, request_id: str, num_computed_tokens: int) -> list[int]:
        """Indices (newest first) of the request's blocks wholly before ``num_computed_tokens - window + 1``
        that still hold a real block."""
        num_skipped_tokens = num_computed_tokens - self.sliding_window + 1
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped_tokens <= 0 or not blocks:
            return []
        indices = []
        for i in range(min(num_skipped_tokens // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before is already released
            indices.append(i)
        return indices

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Swaps blocks wholly before ``num_computed_tokens - sliding_window + 1`` for the null block and
        releases them newest first, so the start of the hash chain is evicted last.
        """
        indices = self._skipped_indices(request_id, num_computed_tokens)
        if not indices:
            return
        blocks = self.req_to_blocks[request_id]
        removed = [blocks[i] for i in indices]
        for i in indices:
            blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(removed)

    def num_kept_by_free_tail(self, request_id: str, num_blocks: int) -> int:
        """None: the front of a kept prefix may have left the window (null blocks), so no prefix is sure to keep
        the window its end needs; ``free_tail`` releases all the request's blocks."""
        return 0

    def num_freed_by_skipping(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks that leaving the window would return to the free queue: those this request alone holds."""
        blocks = self.req_to_blocks.get(request_id, [])
        return sum(1 for i in self._skipped_indices(request_id, num_computed_tokens) if blocks[i].ref_cnt == 1)
