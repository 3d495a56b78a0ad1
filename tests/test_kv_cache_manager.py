"""KVCacheManager: lookup, allocation (all-or-nothing), caching rules, freeing, stats, views, sliding window."""

from __future__ import annotations

import pytest

from vllite.kv_cache import KVCacheBlocks, KVCacheManager, PrefixCacheStats, get_hash_fn, get_request_block_hasher
from vllite.request import Request
from vllite.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], **sp: object) -> Request:
    hasher = get_request_block_hasher(BS, get_hash_fn("sha256"))
    return Request(rid, tokens, SamplingParams(**sp), block_hasher=hasher)  # type: ignore[arg-type]


def run_prefill(mgr: KVCacheManager, req: Request) -> KVCacheBlocks:
    hits, num_hit = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return new


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def snapshot(mgr: KVCacheManager) -> tuple:
    pool = mgr.block_pool
    return (
        free_ids(mgr),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {k: list(v) for k, v in mgr.manager.req_to_blocks.items()},
        dict(mgr.manager.num_cached_block),
    )


# ---------------------------------------------------------------------------- lookup
def test_hit_is_capped_below_num_tokens() -> None:
    mgr = KVCacheManager(10, BS, 64)
    run_prefill(mgr, make_request("a", list(range(12))))
    # Fully cached, length a multiple of the block size: one block fewer, so a token is left to compute.
    hits, n = mgr.get_computed_blocks(make_request("b", list(range(12))))
    assert len(hits) == 2 and n == 8
    hits, n = mgr.get_computed_blocks(make_request("c", list(range(13))))
    assert len(hits) == 3 and n == 12
    assert mgr.get_computed_blocks(make_request("empty", [])) == (mgr.empty_kv_cache_blocks, 0)
    assert mgr.manager.find_longest_cache_hit(make_request("d", list(range(12))).block_hashes, -1) == []


def test_lookup_stops_at_first_miss() -> None:
    mgr = KVCacheManager(10, BS, 64)
    a = make_request("a", [*range(16), 99])
    run_prefill(mgr, a)
    # Same blocks 0, 2, 3 content-wise but block 1 differs: only block 0 hits (later ones chain differently).
    b_tokens = [*range(16), 99]
    b_tokens[5] = 77
    hits, n = mgr.get_computed_blocks(make_request("b", b_tokens))
    assert hits.get_block_ids() == mgr.get_block_ids("a")[:1] and n == 4


def test_lookup_does_not_take_references() -> None:
    mgr = KVCacheManager(10, BS, 64)
    a = make_request("a", list(range(9)))
    run_prefill(mgr, a)
    mgr.free(a)
    before = snapshot(mgr)
    hits, _ = mgr.get_computed_blocks(make_request("b", list(range(9))))
    assert len(hits) == 2 and snapshot(mgr) == before


def test_no_lookup_without_caching_or_with_prompt_logprobs() -> None:
    off = KVCacheManager(10, BS, 64, enable_caching=False)
    a = make_request("a", list(range(9)))
    run_prefill(off, a)
    assert off.num_cached_blocks == 0
    assert off.get_computed_blocks(make_request("b", list(range(9)))) == (off.empty_kv_cache_blocks, 0)
    on = KVCacheManager(10, BS, 64)
    run_prefill(on, make_request("a", list(range(9))))
    req = make_request("p", list(range(9)), prompt_logprobs=1)
    assert on.get_computed_blocks(req) == (on.empty_kv_cache_blocks, 0)


def test_prefix_cache_stats_cumulative_and_interval() -> None:
    mgr = KVCacheManager(20, BS, 64, log_stats=True)
    run_prefill(mgr, make_request("a", list(range(9))))
    run_prefill(mgr, make_request("b", list(range(9))))
    assert mgr.make_prefix_cache_stats() == PrefixCacheStats(requests=2, queries=18, hits=8)
    assert mgr.make_prefix_cache_stats() == PrefixCacheStats()
    run_prefill(mgr, make_request("c", list(range(5))))
    assert mgr.make_prefix_cache_stats() == PrefixCacheStats(requests=1, queries=5, hits=4)
    assert mgr.prefix_cache_stats == PrefixCacheStats(requests=3, queries=23, hits=12)
    assert mgr.prefix_cache_stats.hit_rate == pytest.approx(12 / 23)
    assert PrefixCacheStats().hit_rate == 0.0
    quiet = KVCacheManager(10, BS, 64)
    run_prefill(quiet, make_request("a", list(range(9))))
    assert quiet.make_prefix_cache_stats() is None and quiet.prefix_cache_stats.requests == 1


def test_prefix_cache_stats_count_a_lookup_once_when_the_allocation_succeeds() -> None:
    """A request refused for lack of blocks is looked up again every step; only its admission counts."""
    mgr = KVCacheManager(1 + 3, BS, 64, log_stats=True)
    a = make_request("a", list(range(9)))
    run_prefill(mgr, a)  # 3 blocks: the pool is full, 2 of them cached
    waiting = make_request("w", list(range(9)))
    for _ in range(3):
        hits, num_hit = mgr.get_computed_blocks(waiting)
        assert num_hit == 8 and mgr.allocate_slots(waiting, 1, num_hit, hits) is None
    assert mgr.prefix_cache_stats == PrefixCacheStats(requests=1, queries=9, hits=0)  # only "a" so far
    mgr.free(a)
    hits, num_hit = mgr.get_computed_blocks(waiting)
    assert mgr.allocate_slots(waiting, 1, num_hit, hits) is not None
    waiting.num_computed_tokens = 9
    waiting.append_output_token_ids([9, 10])
    assert mgr.allocate_slots(waiting, 2) is not None  # decode allocations are no lookups
    assert mgr.prefix_cache_stats == PrefixCacheStats(requests=2, queries=18, hits=8)
    assert mgr.make_prefix_cache_stats() == PrefixCacheStats(requests=2, queries=18, hits=8)


# ---------------------------------------------------------------------------- allocation
def test_allocate_returns_only_new_blocks_and_caches_full_ones() -> None:
    mgr = KVCacheManager(10, BS, 64)
    req = make_request("a", list(range(10)))
    new = mgr.allocate_slots(req, 10)
    assert new is not None and new.get_block_ids() == [1, 2, 3]
    assert mgr.num_cached_blocks == 2
    req.num_computed_tokens = 10
    req.append_output_token_ids(10)
    again = mgr.allocate_slots(req, 1)
    assert again is mgr.empty_kv_cache_blocks and len(again) == 0
    assert mgr.num_cached_blocks == 2  # 11 tokens: block 2 still partial


def test_allocate_that_does_not_fit_changes_nothing() -> None:
    mgr = KVCacheManager(6, BS, 64)
    a = make_request("a", list(range(9)))
    run_prefill(mgr, a)
    mgr.free(a)  # blocks 1, 2 cached and evictable
    b = make_request("b", list(range(9)) + list(range(100, 110)))  # 19 tokens: 5 blocks, 2 of them hits
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    mgr.allocate_slots(make_request("x", [7]), 1)  # leaves 4 free, 2 of them the evictable hits
    before = snapshot(mgr)
    # 3 new blocks + 2 evictable hits pulled from the queue = 5 > 4 free.
    assert mgr.allocate_slots(b, 11, n, hits) is None
    assert snapshot(mgr) == before
    assert mgr.get_block_ids("b") == []


def test_evictable_hits_count_against_capacity_but_used_hits_do_not() -> None:
    mgr = KVCacheManager(5, BS, 64)  # 4 usable blocks
    a = make_request("a", list(range(9)))
    run_prefill(mgr, a)  # a holds 3 blocks, 2 of them cached
    b = make_request("b", list(range(9)))
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    new = mgr.allocate_slots(b, 1, n, hits)  # hits are in use: only 1 new block needed
    assert new is not None and len(new) == 1 and mgr.num_free_blocks == 0
    assert [blk.ref_cnt for blk in hits.blocks] == [2, 2]


def test_lookahead_slots_are_allocated_but_never_cached() -> None:
    mgr = KVCacheManager(10, BS, 64)
    req = make_request("a", list(range(6)))
    new = mgr.allocate_slots(req, 6, num_lookahead_tokens=5)
    assert new is not None and len(new) == 3  # 11 slots
    assert mgr.num_cached_blocks == 1
    # Draft tokens beyond request.num_tokens are not cached either.
    req.num_computed_tokens = 6
    req.spec_token_ids = [1, 2, 3]
    mgr.allocate_slots(req, 3)
    assert mgr.num_cached_blocks == 1


def test_delay_cache_blocks_then_cache_blocks() -> None:
    mgr = KVCacheManager(10, BS, 64)
    req = make_request("a", list(range(9)))
    assert mgr.allocate_slots(req, 9, delay_cache_blocks=True) is not None
    assert mgr.num_cached_blocks == 0
    mgr.cache_blocks(req, 4)
    assert mgr.num_cached_blocks == 1
    mgr.cache_blocks(req, 100)  # capped at the request's tokens
    assert mgr.num_cached_blocks == 2
    mgr.cache_blocks(req, 9)  # already cached: nothing to do
    assert mgr.num_cached_blocks == 2


def test_slots_are_capped_at_max_model_len() -> None:
    mgr = KVCacheManager(10, BS, max_model_len=8)
    req = make_request("a", list(range(8)))
    new = mgr.allocate_slots(req, 8, num_lookahead_tokens=4)
    assert new is not None and len(new) == 2


def test_negative_counts_are_rejected() -> None:
    mgr = KVCacheManager(10, BS, 64)
    with pytest.raises(ValueError):
        mgr.allocate_slots(make_request("a", [1]), -1)
    with pytest.raises(ValueError):
        KVCacheManager(10, 0, 64)


# ---------------------------------------------------------------------------- free, views, steps, reset
def test_free_is_reverse_order_and_idempotent() -> None:
    mgr = KVCacheManager(6, BS, 64)
    req = make_request("a", list(range(10)))
    run_prefill(mgr, req)
    assert free_ids(mgr) == [4, 5]
    mgr.free(req)
    # The unhashed tail block goes to the head (reused first), the cached prefix to the tail, reversed.
    assert free_ids(mgr) == [3, 4, 5, 2, 1]
    mgr.free(req)
    assert free_ids(mgr) == [3, 4, 5, 2, 1]
    assert mgr.get_block_ids("a") == [] and len(mgr.get_blocks("a")) == 0
    # Later allocations take the uncached blocks first, then evict the prefix from its end.
    new = mgr.allocate_slots(make_request("b", list(range(50, 70))), 20)
    assert new is not None and new.get_block_ids() == [3, 4, 5, 2, 1]


def test_preempted_request_recovers_its_prefix_from_the_cache() -> None:
    mgr = KVCacheManager(10, BS, 64)
    req = make_request("a", list(range(10)))
    run_prefill(mgr, req)
    ids = mgr.get_block_ids("a")
    mgr.free(req)
    req.num_computed_tokens = 0
    hits, n = mgr.get_computed_blocks(req)
    assert hits.get_block_ids() == ids[:2] and n == 8
    assert mgr.allocate_slots(req, 2, n, hits) is not None
    # The prefix comes back; the partial tail block was not cached, so it went to the queue head on free and is
    # reused for the tail.
    assert mgr.get_block_ids("a") == ids


def test_block_views_and_step_buffer() -> None:
    mgr = KVCacheManager(10, BS, 64)
    a = make_request("a", list(range(5)))
    run_prefill(mgr, a)
    blocks = mgr.get_blocks("a")
    assert blocks.get_block_ids() == mgr.get_block_ids("a") == [1, 2]
    assert blocks.get_unhashed_block_ids() == [2]
    assert mgr.take_new_block_ids() == [1, 2]
    assert mgr.take_new_block_ids() == []
    mgr.allocate_slots(make_request("b", [1]), 1)
    mgr.new_step_starts()
    mgr.allocate_slots(make_request("c", [1]), 1)
    assert mgr.take_new_block_ids() == [4]
    joined = blocks + mgr.get_blocks("c")
    assert joined.get_block_ids() == [1, 2, 4] and len(joined) == 3 and len(blocks) == 2


def test_unhashed_block_ids_skip_the_null_block() -> None:
    mgr = KVCacheManager(10, BS, 64, sliding_window=4)
    req = make_request("a", list(range(13)))
    run_prefill(mgr, req)
    req.append_output_token_ids(13)
    assert mgr.allocate_slots(req, 1) is not None
    blocks = mgr.get_blocks("a")
    assert blocks.blocks[0].is_null  # tokens 0..3 left the window of position 13
    assert blocks.get_unhashed_block_ids() == [blocks.blocks[3].block_id]


def test_usage_free_and_cached_counts() -> None:
    mgr = KVCacheManager(9, BS, 64)
    assert mgr.usage == 0.0 and mgr.num_free_blocks == 8 and mgr.num_blocks == 9
    a = make_request("a", list(range(9)))
    run_prefill(mgr, a)
    assert mgr.usage == pytest.approx(3 / 8) and mgr.num_free_blocks == 5 and mgr.num_cached_blocks == 2
    mgr.free(a)
    assert mgr.usage == 0.0 and mgr.num_cached_blocks == 2


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(10, BS, 64)
    a = make_request("a", list(range(9)))
    run_prefill(mgr, a)
    assert mgr.reset_prefix_cache() is False and mgr.num_cached_blocks == 2
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True and mgr.num_cached_blocks == 0
    assert mgr.get_computed_blocks(make_request("b", list(range(9)))) == (mgr.empty_kv_cache_blocks, 0)
    # With running requests: their blocks lose their hashes and are not re-registered.
    run_prefill(mgr, a)
    assert mgr.reset_prefix_cache(reset_running_requests=True) is True
    a.append_output_token_ids([9, 10, 11])
    mgr.allocate_slots(a, 3)
    assert mgr.num_cached_blocks == 1  # only the newly full third block


# ---------------------------------------------------------------------------- sliding window
def test_sliding_window_releases_blocks_outside_the_window() -> None:
    mgr = KVCacheManager(10, BS, 64, sliding_window=4)
    req = make_request("a", list(range(16)))
    run_prefill(mgr, req)
    assert mgr.get_block_ids("a") == [1, 2, 3, 4]
    req.append_output_token_ids(16)
    # Next token at position 16 attends to 13..16: blocks 0-2 (tokens 0..11) are no longer needed.
    assert mgr.allocate_slots(req, 1) is not None
    assert mgr.get_block_ids("a") == [0, 0, 0, 4, 5]
    assert free_ids(mgr)[-3:] == [3, 2, 1]  # newest released first, so the chain start is evicted last
    mgr.free(req)
    assert 0 not in free_ids(mgr) and mgr.num_free_blocks == 9


def drop_from_cache(mgr: KVCacheManager, block_hash: bytes) -> None:
    """Evicts the cached block holding ``block_hash`` as reuse would, leaving it in the free queue."""
    block = mgr.block_pool.get_cached_block(block_hash)
    assert block is not None and block.ref_cnt == 0
    mgr.block_pool.cached_block_hash_to_block.pop(block_hash, block.block_id)
    block.reset_hash()


@pytest.mark.parametrize(("window", "expected_hit"), [(None, 4), (5, 20), (13, 20), (17, 4)])
def test_hit_with_a_hole_full_attention_vs_sliding_window(window: int | None, expected_hit: int) -> None:
    """Block 1 of a cached 5-block prefix is evicted; the hit is capped at 20 tokens (5 blocks).

    Full attention stops at the hole. A sliding window needs only the cdiv(window - 1, 4) blocks before the
    hit's end, so the run of blocks 2..4 serves windows up to 13 (earlier blocks become null blocks); a window
    of 17 needs 4 blocks, and only the run at the start (block 0) is left.
    """
    mgr = KVCacheManager(20, BS, 64, sliding_window=window)
    a = make_request("a", list(range(21)))
    run_prefill(mgr, a)
    a_ids = mgr.get_block_ids("a")
    mgr.free(a)
    drop_from_cache(mgr, a.block_hashes[1])
    hits, n = mgr.get_computed_blocks(make_request("b", list(range(21))))
    assert n == expected_hit
    ids = hits.get_block_ids()
    if window is None:
        assert ids == a_ids[:1]
    elif n == 20:
        assert ids[1] == 0 and ids[-1] == a_ids[4]
