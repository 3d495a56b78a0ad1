"""Hypothesis state machine for KVCacheManager over several KV-cache groups: the interleavings of
``test_kv_cache_state_machine`` (admit / step / preempt / finish / hog / reset) plus sessions giving up their
tail (``free_tail``), checking after every step the pool's invariants, that every group of a request has the same
length, that a block belongs to one group only and sits at most once in a request, that cached blocks hold their
group's key for their position, and that everything is free once every request is freed.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from kv_cache_support import check_pool_consistent

from tests.test_kv_cache_state_machine import BS, MAX_LEN, KVCacheMachine
from vllite.kv_cache import HybridManager, KVCacheManager, group_block_hashes
from vllite.request import Request
from vllite.sampling_params import SamplingParams

NUM_BLOCKS = 24


class HybridKVCacheMachine(KVCacheMachine):
    """Full attention and a 6-token window: the window's blocks leave mid-flight while the full group keeps its."""

    groups: tuple[int | None, ...] = (None, 6)

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, MAX_LEN, kv_cache_groups=self.groups)
        assert isinstance(self.mgr.manager, HybridManager)
        self.hybrid: HybridManager = self.mgr.manager

    # ------------------------------------------------------------------ rules
    def allocate(self, req: Request, num_new: int, lookahead: int, delay: bool) -> bool:
        if req.num_computed_tokens == 0:
            hits, num_hit = self.mgr.get_computed_blocks(req)
            # A hit is whole logical blocks of every group: G pool blocks per block of tokens.
            assert len(hits) == num_hit // BS * len(self.groups)
        return super().allocate(req, num_new, lookahead, delay)

    @rule(n=st.integers(1, NUM_BLOCKS))
    def hog(self, n: int) -> None:
        """A request of unique tokens takes up to ``n`` pool blocks at once (a block per group per block of
        tokens), evicting cached ones, and runs on."""
        num_positions = min(n, self.mgr.num_free_blocks) // len(self.groups)
        if num_positions == 0:
            return
        tokens = [10_000 + self.next_id] * (num_positions * BS - 1)
        req = Request(f"x{self.next_id}", tokens, SamplingParams(), block_hasher=self.hasher)
        self.next_id += 1
        assert self.allocate(req, len(tokens), 0, False)
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 63), num_blocks=st.integers(1, 8))
    def give_up_tail(self, pick: int, num_blocks: int) -> None:
        """As ``sessions.release_for_memory`` does to a parked session: free pool blocks from the tail, then lower
        ``num_computed_tokens`` to the logical blocks kept (every group keeps as many)."""
        req = self.running[pick % len(self.running)]
        num_held = len(self.mgr.get_block_ids(req.request_id))
        num_kept = self.mgr.free_tail(req, num_blocks)
        assert len(self.mgr.get_block_ids(req.request_id)) == num_kept * len(self.groups)
        if num_kept:
            assert all(window is None for window in self.groups)
            assert num_held - num_kept * len(self.groups) >= min(num_blocks, num_held)
        req.num_computed_tokens = min(req.num_computed_tokens, num_kept * BS)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def pool_is_consistent(self) -> None:
        check_pool_consistent(self.mgr.block_pool, NUM_BLOCKS)

    @invariant()
    def ref_counts_equal_users_and_hashes_match_positions(self) -> None:
        users: dict[int, int] = {}
        group_of: dict[int, int] = {}
        num_groups = len(self.groups)
        for req in self.running:
            blocks = self.mgr.get_blocks(req.request_id).blocks
            assert len(blocks) % num_groups == 0 and len(blocks) // num_groups * BS >= req.num_computed_tokens
            real = [b.block_id for b in blocks if not b.is_null]
            assert len(set(real)) == len(real), "a block sits twice in one request"
            for i, block in enumerate(blocks):
                group, position = i % num_groups, i // num_groups
                if block.is_null:
                    assert self.groups[group] is not None, "the null block in a full-attention group"
                    continue
                assert group_of.setdefault(block.block_id, group) == group, "a block in two groups"
                users[block.block_id] = users.get(block.block_id, 0) + 1
                if block.block_hash is not None:
                    assert block.block_hash == group_block_hashes(req.block_hashes, group)[position]
        for req in self.waiting:
            assert self.mgr.get_block_ids(req.request_id) == []
        for block in self.mgr.block_pool.blocks[1:]:
            assert block.ref_cnt == users.get(block.block_id, 0)

    @invariant()
    def groups_have_equal_lengths(self) -> None:
        tables = [m.req_to_blocks for m in self.hybrid.managers]
        assert all(table.keys() == tables[0].keys() for table in tables)
        for request_id in tables[0]:
            assert len({len(table[request_id]) for table in tables}) == 1

    def teardown(self) -> None:
        for req in self.running:
            self.mgr.free(req)
        pool = self.mgr.block_pool
        assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
        assert all(not m.req_to_blocks and not m.num_cached_block for m in self.hybrid.managers)
        assert self.mgr.usage == 0.0
        assert self.mgr.reset_prefix_cache() is True


class FullPairKVCacheMachine(HybridKVCacheMachine):
    """Two full-attention groups: nothing leaves a window, and ``free_tail`` keeps a prefix of both."""

    groups = (None, None)


class ManySlidingKVCacheMachine(HybridKVCacheMachine):
    """One full group and three windowed ones (Gemma's five-to-one pattern, smaller), two window sizes."""

    groups = (None, 6, 6, 9)


_settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
HybridKVCacheMachine.TestCase.settings = _settings
FullPairKVCacheMachine.TestCase.settings = _settings
ManySlidingKVCacheMachine.TestCase.settings = _settings
TestHybridKVCacheStateMachine = HybridKVCacheMachine.TestCase
TestFullPairKVCacheStateMachine = FullPairKVCacheMachine.TestCase
TestManySlidingKVCacheStateMachine = ManySlidingKVCacheMachine.TestCase
