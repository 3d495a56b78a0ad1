"""The paged KV-cache manager with prefix caching, as in vLLM V1.

``KVCacheManager`` is what the scheduler talks to; ``BlockPool``, ``FreeKVCacheBlockQueue`` and ``KVCacheBlock``
are its parts; ``HybridManager`` keeps the block tables of a model whose layers form several KV-cache groups; the
hashing functions build the chained block hashes that ``Request`` keeps. Nothing here needs torch. How many
blocks fit in memory is the executor's to decide (the default executor's
``vllite.plugins.transformers_executor.kv_cache_sizing``); the engine receives the count.
"""

from vllite import deprecated_aliases
from vllite.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from vllite.kv_cache.block_pool import BlockHashToBlockMap, BlockPool
from vllite.kv_cache.hashing import (
    NONE_HASH,
    generate_block_hash_extra_keys,
    get_hash_fn,
    get_request_block_hasher,
    group_block_hashes,
    hash_block_tokens,
)
from vllite.kv_cache.hybrid import HybridManager
from vllite.kv_cache.manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats

__all__ = [
    "NONE_HASH",
    "BlockHashToBlockMap",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "HybridManager",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
    "generate_block_hash_extra_keys",
    "get_hash_fn",
    "get_request_block_hasher",
    "group_block_hashes",
    "hash_block_tokens",
]


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)  # the sizing functions, now the executor's
