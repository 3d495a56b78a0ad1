"""KVCacheManager over several KV-cache groups (HybridManager): interleaved block runs, per-group windows and
prefix-cache keys, the fixed-point hit, all-or-nothing allocation, freeing and eviction."""

from __future__ import annotations

import pytest

from tests.test_kv_cache_manager import BS, free_ids, make_request, run_prefill, snapshot
from vllite.kv_cache import HybridManager, KVCacheManager, group_block_hashes
from vllite.kv_cache.single_type import FullAttentionManager, SlidingWindowManager
from vllite.kv_events import BlockStored


def groups_of(mgr: KVCacheManager, request_id: str) -> list[list[int]]:
    """Each group's block ids of the request, read from the groups' own managers."""
    assert isinstance(mgr.manager, HybridManager)
    return [[b.block_id for b in m.req_to_blocks.get(request_id, [])] for m in mgr.manager.managers]


def decode(mgr: KVCacheManager, req, num_tokens: int) -> None:
    """Appends and computes ``num_tokens`` tokens one at a time, as decoding does."""
    for i in range(num_tokens):
        req.append_output_token_ids(500 + i)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


# ---------------------------------------------------------------------------- construction
def test_one_group_or_none_is_the_single_type_manager() -> None:
    assert KVCacheManager(8, BS, 64).num_groups == 1
    assert type(KVCacheManager(8, BS, 64, kv_cache_groups=(None,)).manager) is FullAttentionManager
    single = KVCacheManager(8, BS, 64, kv_cache_groups=(8,))
    assert type(single.manager) is SlidingWindowManager and single.sliding_window == 8 and single.num_groups == 1
    hybrid = KVCacheManager(8, BS, 64, kv_cache_groups=[None, 8, 8])
    assert isinstance(hybrid.manager, HybridManager) and hybrid.num_groups == 3
    assert [type(m) for m in hybrid.manager.managers] == [FullAttentionManager, *[SlidingWindowManager] * 2]
    assert [m.group_id for m in hybrid.manager.managers] == [0, 1, 2]


@pytest.mark.parametrize(
    ("window", "groups"), [(None, (None, 0)), (None, (-4,)), (8, (None, 8)), (8, (4,)), (8, (8, 4))]
)
def test_bad_or_contradicting_groups_are_refused(window: int | None, groups: tuple) -> None:
    with pytest.raises(ValueError):
        KVCacheManager(8, BS, 64, sliding_window=window, kv_cache_groups=groups)


def test_min_blocks_for_counts_only_full_attention_groups() -> None:
    assert KVCacheManager(8, BS, 64).min_blocks_for(9) == 3
    assert KVCacheManager(8, BS, 64, sliding_window=8).min_blocks_for(9) == 0
    assert KVCacheManager(8, BS, 64, kv_cache_groups=(None, 8, None)).min_blocks_for(9) == 6
    assert KVCacheManager(8, BS, 64, kv_cache_groups=(8, 8)).min_blocks_for(9) == 0


# ---------------------------------------------------------------------------- interleaving
def test_blocks_are_interleaved_and_every_group_grows_alike() -> None:
    mgr = KVCacheManager(20, BS, 64, kv_cache_groups=(None, None))
    req = make_request("a", list(range(10)))  # 3 logical blocks per group
    new = run_prefill(mgr, req)
    ids = mgr.get_block_ids("a")
    g0, g1 = groups_of(mgr, "a")
    assert len(g0) == len(g1) == 3 and ids == [g0[0], g1[0], g0[1], g1[1], g0[2], g1[2]]
    assert new.get_block_ids() == ids == mgr.get_blocks("a").get_block_ids() == mgr.take_new_block_ids()
    assert len(set(ids)) == 6 and mgr.num_free_blocks == 19 - 6
    req.append_output_token_ids(7)
    req.append_output_token_ids(8)
    more = mgr.allocate_slots(req, 3)  # tokens 10..12: one more logical block per group
    assert more is not None and len(more) == 2
    assert mgr.get_block_ids("a") == [*ids, *more.get_block_ids()]
    assert more.get_block_ids() == [groups_of(mgr, "a")[0][3], groups_of(mgr, "a")[1][3]]
    assert "a" in mgr.manager.req_to_blocks and len(mgr.manager.req_to_blocks) == 1
    assert mgr.manager.req_to_blocks.get("zz") is None and "zz" not in mgr.manager.req_to_blocks


def test_sliding_group_frees_blocks_while_the_full_group_keeps_them() -> None:
    mgr = KVCacheManager(40, BS, 64, kv_cache_groups=(None, 8))
    req = make_request("a", list(range(12)))
    run_prefill(mgr, req)
    decode(mgr, req, 19)  # 31 tokens: 8 logical blocks, the last one partial
    full, sliding = groups_of(mgr, "a")
    assert len(full) == len(sliding) == 8 and 0 not in full
    # Token 30 attends to 23..30: the allocation for it released the window's blocks 0-4 (tokens 0..19).
    assert sliding[:5] == [0] * 5 and 0 not in sliding[5:]
    assert mgr.num_free_blocks == 39 - 8 - 3
    assert mgr.get_block_ids("a")[1::2] == sliding
    blocks = mgr.get_blocks("a")
    assert blocks.get_unhashed_block_ids() == [full[7], sliding[7]]  # the null block is never listed


# ---------------------------------------------------------------------------- prefix caching
def test_hashes_of_different_groups_never_collide() -> None:
    hashes = make_request("h", list(range(12))).block_hashes
    assert group_block_hashes(hashes, 0) is hashes
    keys = [list(group_block_hashes(hashes, g)) for g in range(4)]
    assert len({k for group in keys for k in group}) == 12
    assert group_block_hashes(hashes, 2)[1:] == keys[2][1:] and len(group_block_hashes(hashes, 2)) == 3

    mgr = KVCacheManager(20, BS, 64, kv_cache_groups=(None, 8))
    req = make_request("a", list(range(13)))
    run_prefill(mgr, req)
    assert mgr.num_cached_blocks == 6
    g0, g1 = groups_of(mgr, "a")
    pool = mgr.block_pool
    for i in range(3):
        assert pool.get_cached_block(req.block_hashes[i]).block_id == g0[i]
        assert pool.get_cached_block(group_block_hashes(req.block_hashes, 1)[i]).block_id == g1[i]


def test_a_second_request_shares_every_groups_prefix() -> None:
    mgr = KVCacheManager(20, BS, 64, kv_cache_groups=(None, None))
    a = make_request("a", list(range(13)))
    run_prefill(mgr, a)
    b = make_request("b", [*range(13), 99])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12 and hits.get_block_ids() == mgr.get_block_ids("a")[:6]
    assert mgr.allocate_slots(b, 2, num_hit, hits) is not None
    assert mgr.get_block_ids("b")[:6] == mgr.get_block_ids("a")[:6]
    assert all(block.ref_cnt == 2 for block in hits.blocks)
    assert mgr.prefix_cache_stats.hits == 12


def test_the_hit_is_the_fixed_point_shorter_than_either_group_alone() -> None:
    mgr = KVCacheManager(40, BS, 64, kv_cache_groups=(None, 4))  # a 4-token window needs 1 block before the end
    a = make_request("a", list(range(25)))  # 6 full blocks per group, all cached
    run_prefill(mgr, a)
    full, sliding = groups_of(mgr, "a")
    mgr.free(a)
    # Full attention keeps blocks 0-3, the window blocks 0, 1 and 5.
    mgr.evict_blocks({full[4], full[5], sliding[2], sliding[3], sliding[4]})
    b = make_request("b", list(range(25)))
    hybrid = mgr.manager
    assert isinstance(hybrid, HybridManager)
    assert len(hybrid.managers[0].find_longest_cache_hit(b.block_hashes, 24)) == 4
    assert len(hybrid.managers[1].find_longest_cache_hit(b.block_hashes, 24)) == 6
    # Full: 16 tokens; the window within 16 ends at block 1 (8 tokens); full attention agrees at 8.
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    assert hits.get_block_ids() == [full[0], 0, full[1], sliding[1]]  # block 0 left the window of token 8
    assert mgr.allocate_slots(b, 17, num_hit, hits) is not None
    assert mgr.get_block_ids("b")[:4] == [full[0], 0, full[1], sliding[1]]
    assert len(mgr.get_block_ids("b")) == 14


def test_kv_events_report_each_group_under_its_own_keys() -> None:
    mgr = KVCacheManager(20, BS, 64, kv_cache_groups=(None, 8))
    mgr.block_pool.enable_kv_cache_events(BS)
    req = make_request("a", list(range(9)))
    run_prefill(mgr, req)
    stored = [e for e in mgr.block_pool.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [req.block_hashes[:2], list(group_block_hashes(req.block_hashes, 1))]
    assert all(e.parent_block_hash is None and e.token_ids == list(range(8)) for e in stored)


# ---------------------------------------------------------------------------- allocation
def test_allocation_is_all_or_nothing_across_groups() -> None:
    mgr = KVCacheManager(6, BS, 64, kv_cache_groups=(None, None))  # 5 usable blocks
    big = make_request("big", list(range(12)))  # 3 blocks per group: 6
    before = snapshot(mgr)
    assert mgr.get_num_blocks_short(big, 12) == 1
    assert mgr.allocate_slots(big, 12) is None
    assert snapshot(mgr) == before and mgr.get_block_ids("big") == []
    small = make_request("small", list(range(8)))
    assert mgr.get_num_blocks_short(small, 8) == 0 and mgr.allocate_slots(small, 8) is not None
    assert mgr.num_free_blocks == 1


def test_blocks_leaving_a_window_count_as_freed() -> None:
    """A decode step that needs a block in each group fits when the window releases blocks, not without it."""

    def prefilled(groups: tuple) -> tuple[KVCacheManager, object]:
        mgr = KVCacheManager(8, BS, 64, kv_cache_groups=groups)  # 7 usable blocks
        req = make_request("a", list(range(12)))
        run_prefill(mgr, req)  # 3 blocks per group
        req.append_output_token_ids(5)
        return mgr, req

    mgr, req = prefilled((None, None))
    assert mgr.get_num_blocks_short(req, 1) == 1 and mgr.allocate_slots(req, 1) is None
    mgr, req = prefilled((None, 4))
    # 12 computed: tokens 0..8 left the window of token 12, so sliding blocks 0 and 1 go back to the pool.
    assert mgr.get_num_blocks_short(req, 1) == 0
    new = mgr.allocate_slots(req, 1)
    assert new is not None and len(new) == 2
    assert groups_of(mgr, "a")[1][:2] == [0, 0] and mgr.num_free_blocks == 7 - 8 + 2


# ---------------------------------------------------------------------------- freeing
def test_free_releases_every_group_tail_first_and_is_idempotent() -> None:
    mgr = KVCacheManager(20, BS, 64, kv_cache_groups=(None, 8))
    req = make_request("a", list(range(12)))  # 3 full blocks per group, all cached
    run_prefill(mgr, req)
    ids = mgr.get_block_ids("a")
    mgr.free(req)
    assert free_ids(mgr)[-6:] == ids[::-1]  # the tail of every group is evicted before any prefix
    assert mgr.num_free_blocks == 19 and mgr.get_block_ids("a") == []
    mgr.free(req)
    assert mgr.num_free_blocks == 19
    assert all(m.req_to_blocks == {} and m.num_cached_block == {} for m in mgr.manager.managers)


def test_free_tail_cuts_logical_positions_from_every_group() -> None:
    mgr = KVCacheManager(20, BS, 64, kv_cache_groups=(None, None))
    req = make_request("a", list(range(14)))  # 4 blocks per group, 3 cached
    run_prefill(mgr, req)
    ids = mgr.get_block_ids("a")
    assert mgr.manager.num_cached_block == {"a": 3}
    assert mgr.free_tail(req, 3) == 2  # 3 pool blocks wanted: 2 positions of each group
    assert mgr.get_block_ids("a") == ids[:4] and mgr.num_free_blocks == 19 - 4
    assert mgr.manager.num_cached_block == {"a": 2}
    assert free_ids(mgr)[:2] == [ids[7], ids[6]]  # the unhashed partial blocks are reused first
    assert free_ids(mgr)[-2:] == [ids[5], ids[4]]  # the cached ones keep their hashes, tail first
    assert mgr.free_tail(req, 4) == 0 and mgr.get_block_ids("a") == [] and mgr.num_free_blocks == 19
    assert mgr.free_tail(make_request("b", [1]), 1) == 0


def test_free_tail_with_a_sliding_group_keeps_nothing() -> None:
    mgr = KVCacheManager(20, BS, 64, kv_cache_groups=(None, 8))
    req = make_request("a", list(range(14)))
    run_prefill(mgr, req)
    assert mgr.free_tail(req, 1) == 0
    assert mgr.get_block_ids("a") == [] and mgr.num_free_blocks == 19


def test_evict_blocks_lowers_only_the_affected_groups_cached_count() -> None:
    mgr = KVCacheManager(20, BS, 64, kv_cache_groups=(None, None))
    req = make_request("a", list(range(13)))
    run_prefill(mgr, req)
    _, other = groups_of(mgr, "a")
    mgr.evict_blocks({other[1]})
    assert [m.num_cached_block["a"] for m in mgr.manager.managers] == [3, 1]
    assert mgr.block_pool.get_cached_block(group_block_hashes(req.block_hashes, 1)[1]) is None
    mgr.cache_blocks(req, 13)  # recomputed: registered again, under group 1's key
    assert mgr.block_pool.get_cached_block(group_block_hashes(req.block_hashes, 1)[1]).block_id == other[1]
    assert [m.num_cached_block["a"] for m in mgr.manager.managers] == [3, 3]
