"""Checks the KV-cache property tests share (``test_kv_cache_state_machine.py``, its hybrid twin)."""

from __future__ import annotations

from vllite.kv_cache.block_pool import BlockPool


def check_pool_consistent(pool: BlockPool, num_blocks: int) -> None:
    """The free queue holds each free block once; free plus in-use blocks are all but the null block, which is
    never used or hashed; the hash map lists exactly the blocks holding a hash, under that hash."""
    queued = list(pool.free_block_queue)
    assert len(queued) == pool.get_num_free_blocks()
    assert len({id(b) for b in queued}) == len(queued)
    assert all(b.ref_cnt == 0 and not b.is_null for b in queued)
    in_use = [b for b in pool.blocks if not b.is_null and b.ref_cnt > 0]
    assert len(queued) + len(in_use) == num_blocks - 1
    assert pool.null_block.ref_cnt == 0 and pool.null_block.block_hash is None
    mapped = list(pool.cached_block_hash_to_block.blocks())
    assert all(b.block_hash == h for h, b in mapped)
    assert len(mapped) == len(pool.cached_block_hash_to_block)
    assert {id(b) for _, b in mapped} == {id(b) for b in pool.blocks if b.block_hash is not None}
