"""KVCacheManager.free_tail (a parked session giving up its last blocks) and get_num_blocks_short (how many
blocks an allocation lacks)."""

from __future__ import annotations

from tests.test_kv_cache_manager import BS, free_ids, make_request, run_prefill, snapshot
from vllite.kv_cache import KVCacheManager


def test_free_tail_keeps_the_prefix_and_frees_the_tail_with_its_hashes_tail_first() -> None:
    mgr = KVCacheManager(8, BS, 64)
    req = make_request("a", list(range(14)))  # 4 blocks, 3 full and cached
    run_prefill(mgr, req)
    ids = mgr.get_block_ids("a")
    assert mgr.manager.num_cached_block["a"] == 3
    assert mgr.free_tail(req, 2) == 2
    assert mgr.get_block_ids("a") == ids[:2] and mgr.manager.num_cached_block["a"] == 2
    # The unhashed partial block is reused first; the cached one joins the tail and stays in the prefix cache.
    assert free_ids(mgr)[0] == ids[3] and free_ids(mgr)[-1] == ids[2]
    assert mgr.block_pool.get_cached_block(req.block_hashes[2]) is not None
    # Allocating again lets the request grow from its kept prefix.
    req.num_computed_tokens = 8
    assert mgr.allocate_slots(req, 6) is not None and mgr.get_block_ids("a")[:2] == ids[:2]


def test_free_tail_of_every_block_frees_the_request_and_is_harmless_for_an_unknown_one() -> None:
    mgr = KVCacheManager(8, BS, 64)
    req = make_request("a", list(range(10)))
    run_prefill(mgr, req)
    assert mgr.free_tail(req, 5) == 0
    assert "a" not in mgr.manager.req_to_blocks and "a" not in mgr.manager.num_cached_block
    assert mgr.num_free_blocks == 7
    assert mgr.free_tail(make_request("b", [1]), 1) == 0
    mgr.free(req)  # still idempotent
    assert mgr.num_free_blocks == 7


def test_free_tail_releases_shared_blocks_only_for_this_request() -> None:
    mgr = KVCacheManager(8, BS, 64)
    a = make_request("a", list(range(9)))
    run_prefill(mgr, a)
    b = make_request("b", [*range(9), 50, 51, 52])
    run_prefill(mgr, b)  # shares a's 2 full blocks
    num_free = mgr.num_free_blocks
    assert mgr.free_tail(b, 2) == 1  # its own block and one shared with a
    assert mgr.num_free_blocks == num_free + 1  # the shared block stays a's
    assert mgr.get_block_ids("a")[1] not in free_ids(mgr)


def test_a_sliding_window_keeps_no_prefix() -> None:
    mgr = KVCacheManager(10, BS, 64, sliding_window=4)
    req = make_request("a", list(range(16)))
    run_prefill(mgr, req)
    assert mgr.free_tail(req, 1) == 0 and mgr.get_block_ids("a") == [] and mgr.num_free_blocks == 9


def test_num_blocks_short_matches_allocate_slots_and_changes_nothing() -> None:
    mgr = KVCacheManager(6, BS, 64)  # 5 usable blocks
    a = make_request("a", list(range(9)))
    run_prefill(mgr, a)
    mgr.free(a)  # blocks 1, 2 cached and evictable
    mgr.allocate_slots(make_request("x", [7]), 1)  # 4 free, 2 of them a's cached blocks
    b = make_request("b", list(range(9)) + list(range(100, 110)))  # 19 tokens: 2 hits + 3 new blocks
    hits, n = mgr.get_computed_blocks(b)
    before = snapshot(mgr)
    assert mgr.get_num_blocks_short(b, 11, n, hits) == 1  # 3 new + 2 evictable hits > 4 free
    assert mgr.get_num_blocks_short(b, 7, n, hits) == 0  # 15 tokens: 2 new + 2 hits
    assert mgr.get_num_blocks_short(b, 7, n, hits, num_lookahead_tokens=8) == 2
    assert snapshot(mgr) == before
    assert mgr.allocate_slots(b, 7, n, hits) is not None
