"""``HybridManager``: the block tables of a model whose layers fall into several KV-cache groups (vLLM's
``HybridKVCacheCoordinator``), e.g. Gemma's sliding-window and full-attention layers.

The executor splits the layers into ``G`` groups, each with a window (``None``: full attention). Every group covers
the same token positions, so a request holds one block list per group, all of the same length; a sliding group
holds the null block at positions that left its window. All groups share one ``BlockPool`` and cache under their
own keys (``group_block_hashes``).

Towards ``KVCacheManager`` (and through it the scheduler and the model runner) a request's blocks are
*interleaved*: logical position ``k`` of group ``g`` sits at index ``k * G + g``, so ``blocks[g::G]`` is group
``g``'s list and each allocation appends the same number of blocks to every group.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from vllite.kv_cache.block import KVCacheBlock
from vllite.kv_cache.block_pool import BlockPool
from vllite.kv_cache.single_type import FullAttentionManager, SlidingWindowManager

if TYPE_CHECKING:
    from vllite.request import Request

T = TypeVar("T")


def interleave(per_group: Sequence[Sequence[T]]) -> list[T]:
    """Merges equally long per-group lists so that item ``k`` of group ``g`` lands at ``k * G + g``."""
    return [item for row in zip(*per_group, strict=True) for item in row]


def make_group_manager(
    block_pool: BlockPool, block_size: int, window: int | None, group_id: int
) -> FullAttentionManager:
    """The single-type manager of one KV-cache group: full attention for ``window is None``, else its window."""
    if window is None:
        return FullAttentionManager(block_pool, block_size, group_id)
    return SlidingWindowManager(block_pool, block_size, window, group_id)


class InterleavedBlockTables(Mapping[str, list[KVCacheBlock]]):
    """``request_id -> interleaved blocks`` over the groups' own tables: a read-only view, each lookup a fresh list.

    A request is listed exactly when every group's table lists it (the managers always receive the same calls).
    """

    def __init__(self, managers: Sequence[FullAttentionManager]) -> None:
        self._managers = managers
        self._first = managers[0].req_to_blocks

    def __getitem__(self, request_id: str) -> list[KVCacheBlock]:
        if request_id not in self._first:
            raise KeyError(request_id)
        # .get: the groups' tables are defaultdicts, which a plain lookup would grow.
        return interleave([m.req_to_blocks.get(request_id, []) for m in self._managers])

    def __iter__(self) -> Iterator[str]:
        return iter(self._first)

    def __len__(self) -> int:
        return len(self._first)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._first


class HybridManager:
    """Block tables over several KV-cache groups sharing one pool, with the interface ``KVCacheManager`` calls on a
    single-type manager, in interleaved form (see the module docstring).

    Promises: every group's list of a request has the same length at all times; a prefix-cache hit is a length
    every group hits in full (the fixed point of the groups' own hits); ``free`` and ``free_tail`` release the
    groups' blocks in one interleaved, tail-first order, so the tail of every group is evicted before any prefix.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, windows: Sequence[int | None]) -> None:
        if len(windows) < 2:
            raise ValueError(f"a hybrid KV cache needs at least two groups, got {list(windows)}")
        self.block_pool = block_pool
        self.block_size = block_size
        self.windows = tuple(windows)
        self.managers = [make_group_manager(block_pool, block_size, w, g) for g, w in enumerate(self.windows)]
        self.num_groups = len(self.managers)
        self.req_to_blocks = InterleavedBlockTables(self.managers)

    @property
    def num_cached_block(self) -> dict[str, int]:
        """Leading logical positions each request has cached in every group (a snapshot, for checks)."""
        first = self.managers[0].num_cached_block
        return {rid: min(m.num_cached_block.get(rid, 0) for m in self.managers) for rid in first}

    # ------------------------------------------------------------------ lookup
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[KVCacheBlock]:
        """The interleaved hits of the longest prefix of at most ``max_length`` tokens that every group hits.

        A fixed point: each group in turn shrinks the length to its own longest hit within it, until a whole pass
        leaves it unchanged; that pass's hits, all taken at the final length, are the answer (a sliding group's
        hit depends on where it ends, so hits found at a longer length would not do).
        """
        length = max(0, max_length) // self.block_size * self.block_size
        while True:
            hits: list[list[KVCacheBlock]] = []
            for manager in self.managers:
                group_hits = manager.find_longest_cache_hit(block_hashes, length)
                if len(group_hits) * self.block_size < length:
                    length = len(group_hits) * self.block_size
                    break
                hits.append(group_hits)
            else:
                return interleave(hits)

    # ------------------------------------------------------------------ allocation
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Releases, in every sliding group, the blocks no future token attends to."""
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def num_freed_by_skipping(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks ``remove_skipped_blocks`` would return to the free queue, over all groups (it changes nothing)."""
        return sum(m.num_freed_by_skipping(request_id, num_computed_tokens) for m in self.managers)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free-queue blocks every group together needs for ``num_tokens`` slots, given the interleaved hits."""
        num_groups = self.num_groups
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[g::num_groups])
            for g, m in enumerate(self.managers)
        )

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Attaches the interleaved, already-touched hits to their groups."""
        assert len(new_computed_blocks) % self.num_groups == 0, "hits must cover whole positions of every group"
        for g, manager in enumerate(self.managers):
            manager.save_new_computed_blocks(request_id, new_computed_blocks[g :: self.num_groups])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Gives every group slots for ``num_tokens`` tokens; returns the new blocks, interleaved. The caller has
        checked that the pool holds enough for all groups (``get_num_blocks_to_allocate``)."""
        return interleave([m.allocate_new_blocks(request_id, num_tokens) for m in self.managers])

    def new_step_starts(self) -> None:
        """Forgets the blocks allocated so far: ``take_new_block_ids`` reports only later ones."""
        for manager in self.managers:
            manager.new_step_starts()

    def take_new_block_ids(self) -> list[int]:
        """The ids of the blocks allocated since ``new_step_starts`` (or the previous take), interleaved."""
        return interleave([m.take_new_block_ids() for m in self.managers])

    # ------------------------------------------------------------------ caching
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers, in every group under its own keys, the blocks full within the first ``num_tokens`` tokens."""
        for manager in self.managers:
            manager.cache_blocks(request, num_tokens)

    def uncache_blocks(self, block_ids: set[int]) -> None:
        """Lowers, in every group, each request's count of cached leading blocks to its first block in
        ``block_ids``."""
        for manager in self.managers:
            manager.uncache_blocks(block_ids)

    # ------------------------------------------------------------------ freeing
    def free(self, request_id: str) -> None:
        """Releases every group's blocks of the request in one interleaved order, tail first."""
        blocks = interleave([m.pop_request(request_id) for m in self.managers])
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def free_tail(self, request_id: str, num_blocks: int) -> int:
        """Releases about ``num_blocks`` pool blocks from the request's end: ``ceil(num_blocks / G)`` logical
        positions of every group, tail first. Returns the logical positions kept (all groups keep as many); none
        when any group cannot keep a prefix (a sliding window), in which case everything is released."""
        num_positions = -(-num_blocks // self.num_groups)
        num_kept = min(m.num_kept_by_free_tail(request_id, num_positions) for m in self.managers)
        if num_kept == 0:
            self.free(request_id)
            return 0
        removed = interleave([m.cut_tail(request_id, num_kept) for m in self.managers])
        self.block_pool.free_blocks(reversed(removed))
        return num_kept
