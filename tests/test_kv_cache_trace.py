"""The worked examples of seed 003 (spec PART B5/B6), run through KVCacheManager as the scheduler drives it.

vllite reserves block 0 as the null block (vLLM V1 does too; the seed's v0.8.2 trace did not), so the trace
runs with 11 blocks and every seed block id is shifted by one: the seed's queue ``7 8 9 4 3 2 6 5 1 0`` is
``8 9 10 5 4 3 7 6 2 1`` here.
"""

from __future__ import annotations

from vllite.kv_cache import KVCacheBlocks, KVCacheManager, get_hash_fn, get_request_block_hasher
from vllite.request import Request
from vllite.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    hasher = get_request_block_hasher(BS, get_hash_fn("sha256"))
    return Request(rid, tokens, SamplingParams(max_tokens=64), block_hasher=hasher)


def t(s: str) -> list[int]:
    return [ord(c) for c in s]


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def schedule(mgr: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> list[int]:
    """What the scheduler does for one request in one step; returns the new block ids."""
    hits, num_hit = (mgr.empty_kv_cache_blocks, 0)
    if req.num_computed_tokens == 0:
        hits, num_hit = mgr.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - req.num_computed_tokens - num_hit
    new = mgr.allocate_slots(req, num_new_tokens, num_hit, hits)
    assert new is not None
    req.num_computed_tokens += num_hit + num_new_tokens
    return new.get_block_ids()


def test_seed_003_end_to_end_trace() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=BS, max_model_len=64)
    pool = mgr.block_pool
    assert free_ids(mgr) == list(range(1, 11))

    # step0: req0 = ABCD|EFGH|IJKL|MNO, all scheduled.
    req0 = make_request("req0", t("ABCDEFGHIJKLMNO"))
    assert schedule(mgr, req0) == [1, 2, 3, 4]
    assert [pool.blocks[i].block_hash for i in (1, 2, 3)] == req0.block_hashes
    assert pool.blocks[4].block_hash is None
    assert free_ids(mgr) == [5, 6, 7, 8, 9, 10]

    # step1-3: one prefill output fills MNO + P; the decode of P caches block 4; the next decode needs block 5.
    req0.append_output_token_ids(ord("P"))
    assert schedule(mgr, req0) == []
    assert pool.blocks[4].block_hash == req0.block_hashes[3]
    req0.append_output_token_ids(ord("Q"))
    assert schedule(mgr, req0) == [5]
    assert free_ids(mgr) == [6, 7, 8, 9, 10]

    # step4: req1 = ABCD|EFGH|IJkl|mn hits the first two blocks.
    req1 = make_request("req1", t("ABCDEFGHIJklmn"))
    hits, num_hit = mgr.get_computed_blocks(req1)
    assert hits.get_block_ids() == [1, 2] and num_hit == 8
    assert schedule(mgr, req1) == [6, 7]
    assert mgr.get_block_ids("req1") == [1, 2, 6, 7]
    assert pool.blocks[1].ref_cnt == pool.blocks[2].ref_cnt == 2
    assert pool.blocks[6].block_hash == req1.block_hashes[2]
    assert free_ids(mgr) == [8, 9, 10]

    # step5: req0 finishes; shared blocks stay. Its unhashed tail block (Q) joins the head, to be reused first;
    # the cached ones join the tail in reverse, keeping their hashes.
    mgr.free(req0)
    assert free_ids(mgr) == [5, 8, 9, 10, 4, 3]
    assert pool.blocks[3].block_hash is not None and pool.blocks[4].block_hash is not None

    # step6: req1 finishes: its partial block 7 (mn) to the head, the cached ones to the tail.
    mgr.free(req1)
    assert free_ids(mgr) == [7, 5, 8, 9, 10, 4, 3, 6, 2, 1]

    # step7: req2 = ABCD|EFGH|IJKL + 4 full blocks + 1 token (29 tokens) hits 3 blocks in the free queue.
    req2 = make_request("req2", t("ABCDEFGHIJKL") + list(range(1000, 1017)))
    assert req2.num_tokens == 29
    kept_hash = pool.blocks[4].block_hash
    hits, num_hit = mgr.get_computed_blocks(req2)
    assert hits.get_block_ids() == [1, 2, 3] and num_hit == 12
    assert schedule(mgr, req2) == [7, 5, 8, 9, 10]
    assert mgr.get_block_ids("req2") == [1, 2, 3, 7, 5, 8, 9, 10]
    # The uncached blocks went first, so block 4 (the seed's block 3, holding MNOP) is still cached; the seed's
    # LRU order, which appended every freed block at the tail, evicted it here.
    assert kept_hash is not None and pool.get_cached_block(kept_hash) is pool.blocks[4]
    assert [pool.blocks[i].block_hash for i in (7, 5, 8, 9)] == req2.block_hashes[3:7]
    assert pool.blocks[10].block_hash is None  # holds the 29th token only
    assert free_ids(mgr) == [4, 6]


def test_b5_example_1_waiting_request_with_two_hits_needs_one_block() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS, max_model_len=64)
    warm = make_request("warm", [*t("ABCDEFGH"), 1])
    schedule(mgr, warm)
    mgr.free(warm)
    req = make_request("req1", t("ABCDEFGHIJ"))
    hits, num_hit = mgr.get_computed_blocks(req)
    assert len(hits) == 2 and num_hit == 8  # new computed 2
    num_cached_before = mgr.num_cached_blocks
    new = mgr.allocate_slots(req, 2, num_hit, hits)
    assert new is not None and len(new) == 1  # new 1
    assert mgr.num_cached_blocks == num_cached_before  # full 2, new full 0


def test_b5_example_2_chunked_prefill_is_append_only_and_duplicates_a_hash() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    warm = make_request("warm", [*t("ABCDEFGH"), 1])
    schedule(mgr, warm)
    mgr.free(warm)
    efgh_hash = warm.block_hashes[1]

    # First scheduling sees ABCD only (the seed's simplification: the cache holds just ABCD here).
    req = make_request("req1", t("ABCDEFGHIJ"))
    abcd = mgr.block_pool.get_cached_block(req.block_hashes[0])
    assert abcd is not None
    first = mgr.allocate_slots(req, 2, 4, KVCacheBlocks((abcd,)))
    assert first is not None and len(first) == 1
    req.num_computed_tokens = 6
    # Second scheduling: the running request fills its own block with EFGH instead of swapping in the hit.
    second = mgr.allocate_slots(req, 4)
    assert second is not None and len(second) == 1
    own = mgr.get_blocks("req1").blocks
    assert own[0] is abcd and own[1].block_hash == efgh_hash
    holders = [b for h, b in mgr.block_pool.cached_block_hash_to_block.blocks() if h == efgh_hash]
    assert len(holders) == 2 and own[1] in holders
