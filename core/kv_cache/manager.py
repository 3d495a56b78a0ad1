"""``KVCacheManager``: the facade the scheduler talks to — prefix-cache lookup, slot allocation, freeing.

For one request in one step the token positions fall into these ranges::

    | <computed> | <new computed> | <new> | <lookahead> |
                                  |   to be computed    |
                 |          to be given blocks          |

``computed`` is ``request.num_computed_tokens``; ``new computed`` the prefix-cache hit found by
``get_computed_blocks`` (only at a request's first scheduling); ``new`` the tokens scheduled now; ``lookahead``
slots for speculative draft tokens, which are never cached.

A model whose layers form several KV-cache groups (``kv_cache_groups``, e.g. sliding-window and full-attention
layers) gets a ``HybridManager``; every run of blocks of a request the facade hands out is then interleaved:
logical block ``k`` of group ``g`` at index ``k * num_groups + g`` (the model runner takes ``ids[g::num_groups]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllite.kv_cache.block import KVCacheBlock
from vllite.kv_cache.block_pool import BlockPool
from vllite.kv_cache.hybrid import HybridManager
from vllite.kv_cache.single_type import FullAttentionManager, SlidingWindowManager

if TYPE_CHECKING:
    from vllite.request import Request


@dataclass(slots=True, frozen=True)
class KVCacheBlocks:
    """An ordered, read-only run of blocks handed between the KV-cache manager and the scheduler."""

    blocks: Sequence[KVCacheBlock]

    def get_block_ids(self) -> list[int]:
        """The block ids, in order."""
        return [block.block_id for block in self.blocks]

    def get_unhashed_block_ids(self) -> list[int]:
        """The ids of blocks not (yet) registered in the prefix cache; the null block (positions outside a sliding
        window) is no block of the request's and never listed."""
        return [block.block_id for block in self.blocks if block.block_hash is None and not block.is_null]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks((*self.blocks, *other.blocks))

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups: ``requests`` looked up, ``queries`` (tokens asked for) and ``hits`` (tokens found)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Adds one request's lookup."""
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens


def _check_groups(kv_cache_groups: Sequence[int | None], sliding_window: int | None) -> tuple[int | None, ...]:
    """The groups' windows as a tuple, after checking that each window is positive and that ``sliding_window``
    (the single-group spelling, which wins over a lone group's ``None``) does not contradict them."""
    groups = tuple(kv_cache_groups)
    if any(window is not None and window <= 0 for window in groups):
        raise ValueError(f"every KV-cache group's window must be positive or None, got {list(groups)}")
    # sliding_window says every layer uses that window: no group may have another (a lone group may leave it out).
    lone = len(groups) == 1
    if sliding_window is not None and any(w != sliding_window for w in groups if w is not None or not lone):
        raise ValueError(f"sliding_window={sliding_window} contradicts kv_cache_groups={list(groups)}")
    return groups


def _skips_prefix_cache(request: Request) -> bool:
    # Prompt logprobs need logits at every prompt position, which cached positions never produce.
    if getattr(request, "skip_reading_prefix_cache", False):
        return True
    params = getattr(request, "sampling_params", None)
    return params is not None and getattr(params, "prompt_logprobs", None) is not None


class KVCacheManager:
    """Paged KV-cache bookkeeping for all requests: ``num_blocks`` blocks of ``block_size`` tokens (block 0 is
    the null block), with prefix caching when ``enable_caching``.

    Promises: ``allocate_slots`` either succeeds completely (for every KV-cache group) or returns ``None`` having
    changed nothing (apart from releasing blocks outside a sliding window); a request's block list is append-only
    until ``free`` or ``free_tail``; ``free`` is idempotent.

    ``kv_cache_groups``: the window of each KV-cache group of the model's layers (``None``: full attention). With
    none or one group the cache behaves as a single group (one entry stands for ``sliding_window``); with two or
    more every group gets its own blocks from the shared pool and request block runs are interleaved.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        log_stats: bool = False,
        sliding_window: int | None = None,
        kv_cache_groups: Sequence[int | None] = (),
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.kv_cache_groups = _check_groups(kv_cache_groups, sliding_window)
        if len(self.kv_cache_groups) == 1 and sliding_window is None:
            sliding_window = self.kv_cache_groups[0]
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.manager: FullAttentionManager | HybridManager
        if len(self.kv_cache_groups) > 1:
            self.manager = HybridManager(self.block_pool, block_size, self.kv_cache_groups)
        elif sliding_window:
            self.manager = SlidingWindowManager(self.block_pool, block_size, sliding_window)
        else:
            self.manager = FullAttentionManager(self.block_pool, block_size)
        self.empty_kv_cache_blocks = KVCacheBlocks(())
        self.prefix_cache_stats = PrefixCacheStats()
        self._interval_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None

    # ------------------------------------------------------------------ figures
    @property
    def num_groups(self) -> int:
        """The number of KV-cache groups: how many blocks each logical block position of a request takes."""
        return max(1, len(self.kv_cache_groups))

    def min_blocks_for(self, num_tokens: int) -> int:
        """The fewest pool blocks a request holds once it has slots for ``num_tokens`` tokens: one per block of
        tokens in each full-attention group; sliding-window groups, which may hold just their window, count 0."""
        if len(self.kv_cache_groups) > 1:
            num_full = sum(1 for window in self.kv_cache_groups if window is None)
        else:
            num_full = 0 if self.sliding_window else 1
        return num_full * -(-max(0, num_tokens) // self.block_size)

    @property
    def usage(self) -> float:
        """The fraction of usable blocks in use, in [0, 1]."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (empty or evictable)."""
        return self.block_pool.get_num_free_blocks()

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash, in use or evictable."""
        return self.block_pool.num_cached_blocks

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix-cache stats since the previous call, or ``None`` unless ``log_stats``."""
        if self._interval_stats is None:
            return None
        stats, self._interval_stats = self._interval_stats, PrefixCacheStats()
        return stats

    # ------------------------------------------------------------------ lookup and allocation
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request and its length in tokens.

        It covers at most ``num_tokens - 1`` tokens, so at least one token is computed and yields logits. The
        blocks are not referenced yet: pass them to ``allocate_slots``, which touches them and records the lookup
        in the stats. A lookup alone records nothing, so a request refused for lack of blocks and looked up again
        next step counts once, when it is admitted.
        """
        if not self.enable_caching or _skips_prefix_cache(request):
            return self.empty_kv_cache_blocks, 0
        hits = self.manager.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        num_hit_tokens = len(hits) // self.num_groups * self.block_size
        if not hits:
            return self.empty_kv_cache_blocks, 0
        return KVCacheBlocks(hits), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Gives the request slots for its new (and lookahead) tokens, attaching prefix-cache hits first.

        Returns the newly allocated blocks (possibly none), or ``None`` when the free blocks do not suffice, in
        which case nothing changed. The first allocation of a request (none since it arrived or was freed) records
        its prefix-cache lookup: ``num_tokens`` queried, ``num_new_computed_tokens`` hit. Afterwards, unless
        ``delay_cache_blocks``, the blocks full within ``num_computed_tokens + num_new_computed_tokens +
        num_new_tokens`` tokens (never lookahead slots) are registered in the prefix cache.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"num_new_tokens ({num_new_tokens}) and num_lookahead_tokens ({num_lookahead_tokens}) "
                "must not be negative"
            )
        hit_blocks: Sequence[KVCacheBlock] = new_computed_blocks.blocks if new_computed_blocks else ()
        request_id = request.request_id
        total_computed, num_tokens_need_slot = self._span(
            request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens
        )
        if self._num_short(request_id, total_computed, num_tokens_need_slot, hit_blocks) > 0:
            return None
        self.manager.remove_skipped_blocks(request_id, total_computed)

        if request_id not in self.manager.req_to_blocks:
            self._record_lookup(request, num_new_computed_tokens)
        if hit_blocks:
            # Touch before allocating, or the free-queue head could hand out (and evict) a hit.
            self.block_pool.touch(hit_blocks)
            self.manager.save_new_computed_blocks(request_id, hit_blocks)
        new_blocks = self.manager.allocate_new_blocks(request_id, num_tokens_need_slot)

        if self.enable_caching and not delay_cache_blocks:
            self.manager.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return KVCacheBlocks(new_blocks) if new_blocks else self.empty_kv_cache_blocks

    def get_num_blocks_short(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        *,
        reserved_blocks: int = 0,
    ) -> int:
        """How many blocks ``allocate_slots`` with the same arguments lacks (0: it would succeed) when
        ``reserved_blocks`` must stay free after it; it changes nothing."""
        hit_blocks: Sequence[KVCacheBlock] = new_computed_blocks.blocks if new_computed_blocks else ()
        total_computed, num_tokens_need_slot = self._span(
            request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens
        )
        return self._num_short(request.request_id, total_computed, num_tokens_need_slot, hit_blocks, reserved_blocks)

    def _span(
        self, request: Request, num_new_tokens: int, num_new_computed_tokens: int, num_lookahead_tokens: int
    ) -> tuple[int, int]:
        """Tokens computed once the hits are attached, and tokens that then need a slot (within max_model_len)."""
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        return total_computed, min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)

    def _num_short(
        self,
        request_id: str,
        total_computed: int,
        num_tokens_need_slot: int,
        hit_blocks: Sequence[KVCacheBlock],
        reserved_blocks: int = 0,
    ) -> int:
        # Blocks leaving a sliding window make room, but are only released once the allocation is sure to fit:
        # a refused allocation changes nothing.
        num_to_allocate = self.manager.get_num_blocks_to_allocate(request_id, num_tokens_need_slot, hit_blocks)
        num_freed = self.manager.num_freed_by_skipping(request_id, total_computed)
        return max(0, num_to_allocate + reserved_blocks - self.block_pool.get_num_free_blocks() - num_freed)

    def _record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_caching or request.num_computed_tokens or _skips_prefix_cache(request):
            return
        self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        if self._interval_stats is not None:
            self._interval_stats.record(request.num_tokens, num_hit_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's blocks that are full within its first ``num_computed_tokens`` tokens (the
        deferred half of ``allocate_slots(..., delay_cache_blocks=True)``). A no-op without caching.
        """
        if self.enable_caching:
            self.manager.cache_blocks(request, min(num_computed_tokens, request.num_tokens))

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, so its tail is evicted before its prefix. Idempotent."""
        self.manager.free(request.request_id)

    def free_tail(self, request: Request, num_blocks: int) -> int:
        """Releases the last ``num_blocks`` blocks of a request no worker holds (a session parked between turns),
        tail first, keeping their hashes; returns how many blocks it keeps. The caller lowers the request's
        ``num_computed_tokens`` to the kept blocks. A sliding window keeps none."""
        return self.manager.free_tail(request.request_id, num_blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Removes ``block_ids`` from the prefix cache (their KV is wrong: a failed load, or computed on top of
        one). Requests holding them keep them; each such request will register them again once it has recomputed
        them (its count of cached leading blocks drops to the first evicted position)."""
        if not block_ids:
            return
        self.block_pool.evict_blocks(block_ids)
        self.manager.uncache_blocks(block_ids)

    # ------------------------------------------------------------------ per-request views
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """A snapshot of the request's blocks, in order (interleaved over groups; empty for an unknown request)."""
        blocks = self.manager.req_to_blocks.get(request_id)
        return KVCacheBlocks(tuple(blocks)) if blocks else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, in order (interleaved over groups; empty for an unknown request)."""
        return [block.block_id for block in self.manager.req_to_blocks.get(request_id, ())]

    # ------------------------------------------------------------------ steps and resets
    def new_step_starts(self) -> None:
        """Starts a new step: ``take_new_block_ids`` will report only blocks allocated from now on."""
        self.manager.new_step_starts()

    def take_new_block_ids(self) -> list[int]:
        """The ids of blocks allocated since ``new_step_starts`` (or the previous take), and forgets them."""
        return self.manager.take_new_block_ids()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached hash; refuses (False) while blocks are in use unless ``reset_running_requests``,
        in which case blocks in use lose their hashes too and are never shared again. The caller preempts
        running requests first when their KV is stale (e.g. after a weight update).
        """
        return self.block_pool.reset_prefix_cache(reset_running_requests)
