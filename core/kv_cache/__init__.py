"""The paged KV-cache manager with prefix caching, as in vLLM V1.

``KVCacheManager`` is what the scheduler talks to; ``BlockPool``, ``FreeKVCacheBlockQueue`` and ``KVCacheBlock``
are its parts; the hashing functions build the chained block hashes that ``Request`` keeps; the sizing functions
turn a memory budget into a block count. Nothing here needs torch.
"""

from vllite.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from vllite.kv_cache.block_pool import BlockHashToBlockMap, BlockPool
from vllite.kv_cache.hashing import (
    NONE_HASH,
    generate_block_hash_extra_keys,
    get_hash_fn,
    get_request_block_hasher,
    hash_block_tokens,
)
from vllite.kv_cache.manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from vllite.kv_cache.sizing import (
    CPU_KVCACHE_SPACE_ENV,
    DEFAULT_CPU_KVCACHE_SPACE_GIB,
    cpu_kvcache_space_bytes,
    determine_num_blocks,
    gpu_kvcache_space_bytes,
    kv_cache_bytes_per_token,
)

__all__ = [
    "CPU_KVCACHE_SPACE_ENV",
    "DEFAULT_CPU_KVCACHE_SPACE_GIB",
    "NONE_HASH",
    "BlockHashToBlockMap",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
    "cpu_kvcache_space_bytes",
    "determine_num_blocks",
    "generate_block_hash_extra_keys",
    "get_hash_fn",
    "get_request_block_hasher",
    "gpu_kvcache_space_bytes",
    "hash_block_tokens",
    "kv_cache_bytes_per_token",
]
