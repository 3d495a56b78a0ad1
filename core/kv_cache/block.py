"""One physical KV-cache block, and the free queue that threads through the blocks themselves.

A ``KVCacheBlock`` holds no KV data (that lives in the model runner's cache tensors); it is the bookkeeping
for one block: how many requests use it, which hash it holds if it is cached, and its place in the free queue.

``FreeKVCacheBlockQueue`` is an intrusive doubly-linked list: the ``prev_free_block`` / ``next_free_block``
links live in the blocks, and two sentinel blocks bound the list, so every operation is O(1) per block, has no
edge cases, and allocates nothing. Python's ``deque`` cannot remove from the middle in O(1), which a prefix-cache
hit on an evictable block needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from vllite.exceptions import KVCacheStateError


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Bookkeeping for one physical KV-cache block.

    ``ref_cnt`` counts the requests using the block. ``block_hash`` is set while the block is registered in the
    prefix cache, which it stays (even at ``ref_cnt == 0``, as an eviction candidate) until it is reused for
    other data or the cache is reset. The free-list links are ``None`` exactly when the block is not in a
    ``FreeKVCacheBlockQueue``. ``is_null`` marks the reserved block 0, which stands for positions that hold no
    KV (for example outside a sliding window) and is never handed out.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def reset_hash(self) -> None:
        """Forgets the block's hash (it is evicted from the prefix cache or the cache is reset)."""
        self.block_hash = None

    def __repr__(self) -> str:
        # The default repr would follow the free-list links through the whole queue.
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hash={self.block_hash.hex()[:8] if self.block_hash else None}"
            f"{', null' if self.is_null else ''})"
        )


class FreeKVCacheBlockQueue:
    """The free (and evictable) blocks in eviction order: allocation pops from the head.

    The pool puts freed blocks that hold no cached prefix at the head and cached ones at the tail, so empty
    blocks are reused first and cached blocks freed longest ago are evicted next.
    Every method is O(1) per block touched and allocates no per-block objects.
    ``num_free_blocks`` is always the number of real blocks in the list.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # Sentinels: never popped or returned, so every real block always has both neighbours.
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the head block; raises ``ValueError`` when the queue is empty."""
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail or block is None:
            raise ValueError("No free blocks available")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Removes and returns the first ``n`` blocks, head first, in one walk; the head is rewired once."""
        if n == 0:
            return []
        assert self.num_free_blocks >= n, f"Cannot pop {n} blocks from a queue of {self.num_free_blocks}"
        self.num_free_blocks -= n
        out: list[KVCacheBlock] = []
        curr = self.fake_free_list_head.next_free_block
        for _ in range(n):
            assert curr is not None
            out.append(curr)
            nxt = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = nxt
        assert curr is not None
        self.fake_free_list_head.next_free_block = curr
        curr.prev_free_block = self.fake_free_list_head
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlinks ``block`` from anywhere in the queue; ``KVCacheStateError`` if it is not in the queue."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise KVCacheStateError(f"remove() called on invalid block: {block}")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Adds ``block`` at the tail (most recently freed, evicted last)."""
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds ``blocks`` at the tail in the given order, rewiring the tail sentinel once."""
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        count = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += count

    def appendleft_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds ``blocks`` at the head, the first of them becoming the new head, rewiring the head sentinel once."""
        first = self.fake_free_list_head.next_free_block
        assert first is not None
        prev = self.fake_free_list_head
        count = 0
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            count += 1
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The blocks from head to tail (a copy; for tests, stats and debugging, not the hot path)."""
        return list(self)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        curr = self.fake_free_list_head.next_free_block
        while curr is not None and curr is not self.fake_free_list_tail:
            yield curr
            curr = curr.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
