"""Hypothesis state machine: random interleavings of admit / step / preempt / finish / hog (evict) / reset over many
requests with shared prefixes, driving KVCacheManager as the scheduler does, checking the pool's invariants
after every step and that everything is free once every request is freed.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_cache_support import check_pool_consistent

from vllite.kv_cache import KVCacheManager, get_hash_fn, get_request_block_hasher
from vllite.request import Request
from vllite.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 10
MAX_LEN = 48
# Shared prefixes of 0 to 3 blocks (the last one ends mid-block).
PREFIXES = [[], list(range(100, 108)), list(range(100, 112)), list(range(200, 210))]


class KVCacheMachine(RuleBasedStateMachine):
    sliding_window: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, MAX_LEN, sliding_window=self.sliding_window)
        self.hasher = get_request_block_hasher(BS, get_hash_fn("fast"))
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.next_id = 0

    # ------------------------------------------------------------------ helpers
    def snapshot(self) -> tuple:
        pool = self.mgr.block_pool
        return (
            [b.block_id for b in pool.free_block_queue],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {k: list(v) for k, v in self.mgr.manager.req_to_blocks.items() if v},
        )

    def allocate(self, req: Request, num_new: int, lookahead: int, delay: bool) -> bool:
        hits, num_hit = self.mgr.empty_kv_cache_blocks, 0
        if req.num_computed_tokens == 0:
            hits, num_hit = self.mgr.get_computed_blocks(req)
            assert num_hit < req.num_tokens and num_hit % BS == 0
            num_new = min(num_new, req.num_tokens - num_hit)
        before = self.snapshot()
        old_ids = self.mgr.get_block_ids(req.request_id)
        new = self.mgr.allocate_slots(req, num_new, num_hit, hits, lookahead, delay_cache_blocks=delay)
        if new is None:
            assert self.snapshot() == before, "a refused allocation changed state"
            return False
        # Append-only: earlier positions keep their block (a sliding window may swap in the null block).
        ids = self.mgr.get_block_ids(req.request_id)
        assert all(i in (o, 0) for o, i in zip(old_ids, ids)) and len(ids) >= len(old_ids)
        assert ids[len(ids) - len(new) :] == new.get_block_ids()
        req.num_computed_tokens += num_hit + num_new
        if delay:
            self.mgr.cache_blocks(req, req.num_computed_tokens)
        return True

    def preempt(self, req: Request) -> None:
        self.mgr.free(req)
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.insert(0, req)

    # ------------------------------------------------------------------ rules
    @rule(prefix=st.sampled_from(range(len(PREFIXES))), suffix=st.lists(st.integers(0, 3), max_size=10))
    def add_request(self, prefix: int, suffix: list[int]) -> None:
        tokens = PREFIXES[prefix] + suffix or [7]
        req = Request(f"r{self.next_id}", tokens, SamplingParams(), block_hasher=self.hasher)
        self.next_id += 1
        self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(chunk=st.integers(1, 24), delay=st.booleans())
    def admit(self, chunk: int, delay: bool) -> None:
        req = self.waiting[0]
        if self.allocate(req, chunk, 0, delay):
            self.waiting.pop(0)
            self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(
        pick=st.integers(0, 63),
        chunk=st.integers(1, 8),
        token=st.integers(0, 3),
        lookahead=st.integers(0, 3),
        delay=st.booleans(),
    )
    def step(self, pick: int, chunk: int, token: int, lookahead: int, delay: bool) -> None:
        req = self.running[pick % len(self.running)]
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining == 0:  # decode: the previous step sampled a token
            if req.num_tokens >= MAX_LEN - 1:
                return
            req.append_output_token_ids(token)
            remaining = 1
            chunk = 1
        if not self.allocate(req, min(chunk, remaining), lookahead, delay):
            # As the scheduler does: preempt the most recently admitted request and try again later.
            self.preempt(self.running[-1])

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 63), twice=st.booleans())
    def finish(self, pick: int, twice: bool) -> None:
        req = self.running.pop(pick % len(self.running))
        self.mgr.free(req)
        if twice:
            self.mgr.free(req)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 63))
    def preempt_one(self, pick: int) -> None:
        self.preempt(self.running[pick % len(self.running)])

    @rule(n=st.integers(1, NUM_BLOCKS))
    def hog(self, n: int) -> None:
        """A request of unique tokens takes up to ``n`` blocks at once, evicting cached ones, and runs on."""
        n = min(n, self.mgr.num_free_blocks)
        if n == 0:
            return
        tokens = [10_000 + self.next_id] * (n * BS - 1)
        req = Request(f"x{self.next_id}", tokens, SamplingParams(), block_hasher=self.hasher)
        self.next_id += 1
        assert self.allocate(req, len(tokens), 0, False)
        self.running.append(req)

    @rule(force=st.booleans())
    def reset(self, force: bool) -> None:
        in_use = any(self.mgr.get_block_ids(r.request_id) for r in self.running)
        assert self.mgr.reset_prefix_cache(reset_running_requests=force) is (force or not in_use)
        if force or not in_use:
            assert self.mgr.num_cached_blocks == 0

    # ------------------------------------------------------------------ invariants
    @invariant()
    def pool_is_consistent(self) -> None:
        check_pool_consistent(self.mgr.block_pool, NUM_BLOCKS)

    @invariant()
    def ref_counts_equal_users_and_hashes_match_positions(self) -> None:
        users: dict[int, int] = {}
        for req in self.running:
            blocks = self.mgr.get_blocks(req.request_id).blocks
            assert len(blocks) * BS >= req.num_computed_tokens
            for i, block in enumerate(blocks):
                users[block.block_id] = users.get(block.block_id, 0) + 1
                if block.block_hash is not None:
                    assert block.block_hash == req.block_hashes[i]
        for req in self.waiting:
            assert self.mgr.get_block_ids(req.request_id) == []
        for block in self.mgr.block_pool.blocks[1:]:
            assert block.ref_cnt == users.get(block.block_id, 0)

    def teardown(self) -> None:
        for req in self.running:
            self.mgr.free(req)
        pool = self.mgr.block_pool
        assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
        assert self.mgr.usage == 0.0
        assert self.mgr.reset_prefix_cache() is True


class SlidingWindowKVCacheMachine(KVCacheMachine):
    """The same interleavings with a 6-token sliding window: blocks leave requests mid-flight."""

    sliding_window = 6


_settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
KVCacheMachine.TestCase.settings = _settings
SlidingWindowKVCacheMachine.TestCase.settings = _settings
TestKVCacheStateMachine = KVCacheMachine.TestCase
TestSlidingWindowKVCacheStateMachine = SlidingWindowKVCacheMachine.TestCase
