"""BlockPool: null block, allocation with eviction, touch, free, caching, reset, usage; the hash map."""

from __future__ import annotations

import pytest

from vllite.exceptions import KVCacheStateError
from vllite.kv_cache import BlockHashToBlockMap, BlockPool, KVCacheBlock, get_hash_fn, get_request_block_hasher
from vllite.request import Request
from vllite.sampling_params import SamplingParams


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def make_request(tokens: list[int], block_size: int = 4, rid: str = "r") -> Request:
    hasher = get_request_block_hasher(block_size, get_hash_fn("sha256"))
    return Request(rid, tokens, SamplingParams(), block_hasher=hasher)


def test_block_zero_is_the_null_block_and_never_queued() -> None:
    pool = BlockPool(5)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert 0 not in free_ids(pool)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_blocks_takes_the_head_with_ref_one() -> None:
    pool = BlockPool(6)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in got)
    assert free_ids(pool) == [4, 5]
    with pytest.raises(ValueError, match="Cannot get 3 free blocks"):
        pool.get_new_blocks(3)
    assert free_ids(pool) == [4, 5]  # a refused request changes nothing


def test_cache_full_blocks_then_eviction_drops_the_hash() -> None:
    pool = BlockPool(4)
    req = make_request(list(range(9)))  # 2 full blocks + 1 token
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert blocks[0].block_hash == req.block_hashes[0] and blocks[1].block_hash == req.block_hashes[1]
    assert blocks[2].block_hash is None
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    assert pool.num_cached_blocks == 2
    # Free keeps hashes: tail first, so block 3, then 2, then 1 in the queue.
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    assert pool.num_cached_blocks == 2 and blocks[0].block_hash is not None
    # Reusing block 2 (holding hash 1) evicts it; block 1 stays cached.
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [3, 2]
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert pool.num_cached_blocks == 1


def test_cache_full_blocks_needs_the_hashes() -> None:
    pool = BlockPool(4)
    req = Request("nohash", list(range(8)), SamplingParams())
    with pytest.raises(KVCacheStateError, match="block_hasher"):
        pool.cache_full_blocks(req, pool.get_new_blocks(2), 0, 2)


def test_touch_revives_a_free_cached_block_and_shares_a_used_one() -> None:
    pool = BlockPool(5)
    req = make_request(list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 2, 1]
    pool.touch([blocks[0]])  # from the middle of the queue
    assert blocks[0].ref_cnt == 1 and free_ids(pool) == [3, 4, 2]
    pool.touch([blocks[0]])  # already in use: only the count grows
    assert blocks[0].ref_cnt == 2 and free_ids(pool) == [3, 4, 2]


def test_free_enqueues_only_blocks_reaching_zero() -> None:
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # shared by a second user
    pool.free_blocks([b, a])
    assert a.ref_cnt == 1 and b.ref_cnt == 0
    assert free_ids(pool) == [2, 3, 4]  # no hash: at the head
    pool.free_blocks([a])
    assert free_ids(pool) == [1, 2, 3, 4]
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([a])


def test_free_puts_uncached_blocks_at_the_head_and_cached_ones_at_the_tail() -> None:
    """Blocks holding no prefix are reused before any cached block is evicted (vLLM's order)."""
    pool = BlockPool(7)
    req = Request("r", list(range(8)), SamplingParams(), block_hasher=get_request_block_hasher(4, get_hash_fn("fast")))
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, blocks, 0, 2)  # blocks 1 and 2 cached, 3 and 4 not
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 5, 6, 2, 1]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [4, 3, 5, 6]
    assert pool.num_cached_blocks == 2  # nothing evicted yet


def test_usage_counts_usable_blocks_only() -> None:
    pool = BlockPool(5)
    assert pool.get_usage() == 0.0
    pool.get_new_blocks(1)
    assert pool.get_usage() == pytest.approx(0.25)
    pool.get_new_blocks(3)
    assert pool.get_usage() == 1.0
    assert BlockPool(1).get_usage() == 0.0


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    pool = BlockPool(5)
    req = make_request(list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 2
    assert pool.reset_prefix_cache(reset_running_requests=True) is True
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in pool.blocks)
    assert blocks[0].ref_cnt == 1  # still owned by its request
    pool.free_blocks(blocks)
    again = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, again, 0, 2)
    pool.free_blocks(again)
    assert pool.num_cached_blocks == 2
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(req.block_hashes[0]) is None


def test_hash_map_holds_several_blocks_per_hash() -> None:
    m = BlockHashToBlockMap()
    a, b, c = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    m.insert(b"h", a)
    m.insert(b"h", b)
    m.insert(b"g", c)
    assert len(m) == 3 and m.num_hashes() == 2
    assert m.get_one_block(b"h") in (a, b)
    assert m.pop(b"h", 3) is None  # not under this hash
    assert m.pop(b"h", 1) is a
    assert m.get_one_block(b"h") is b
    assert m.pop(b"h", 2) is b
    assert m.get_one_block(b"h") is None and m.pop(b"h", 2) is None
    assert m.pop(b"g", 9) is None and m.pop(b"g", 3) is c
    assert len(m) == 0 and list(m.blocks()) == []
