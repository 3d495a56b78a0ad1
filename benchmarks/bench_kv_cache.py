"""Micro-benchmark of the KV-cache manager (not a test): microseconds per block for

- allocate + cache + free of fresh prompts (prefix-cache misses, evicting the previous round's blocks);
- the same with a full prefix-cache hit (lookup, touch, free);
- block hashing with ``sha256`` and ``fast``, through the per-request hasher and through ``hash_block_tokens``.

Run: ``python benchmarks/bench_kv_cache.py [--block-size 16] [--blocks-per-request 64] [--requests 64]``.
"""

from __future__ import annotations

import argparse
import random

import _common as common

from vllite.kv_cache import KVCacheManager, get_hash_fn, get_request_block_hasher, hash_block_tokens
from vllite.request import Request
from vllite.sampling_params import SamplingParams


def make_prompts(num: int, num_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32000) for _ in range(num_tokens)] for _ in range(num)]


def bench_allocate(args: argparse.Namespace, hit: bool) -> float:
    bs, per_req, n = args.block_size, args.blocks_per_request, args.requests
    num_tokens = per_req * bs
    hasher = get_request_block_hasher(bs, get_hash_fn("fast"))
    # Room for one request at a time plus the cache of one round, so a miss round evicts the previous one.
    mgr = KVCacheManager(n * per_req + per_req + 1, bs, num_tokens + 1)
    rounds = [make_prompts(n, num_tokens, seed) for seed in range(args.repeat + 1)]

    def build(prompts: list[list[int]]) -> list[Request]:
        return [Request(f"r{i}", p, SamplingParams(), block_hasher=hasher) for i, p in enumerate(prompts)]

    def run(reqs: list[Request]) -> None:
        for req in reqs:
            hits, num_hit = mgr.get_computed_blocks(req)
            new = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
            assert new is not None
            mgr.free(req)

    run(build(rounds[0]))  # warm the cache
    if hit:
        batches = [build(rounds[0]) for _ in range(args.repeat)]
    else:
        batches = [build(p) for p in rounds[1:]]
    it = iter(batches)
    seconds = common.best_of(args.repeat, lambda: run(next(it)))
    return seconds / (n * per_req) * 1e6


def bench_request_hasher(args: argparse.Namespace, algo: str) -> float:
    bs = args.block_size
    num_blocks = args.blocks_per_request * args.requests
    hasher = get_request_block_hasher(bs, get_hash_fn(algo))
    req = Request("h", make_prompts(1, num_blocks * bs, 0)[0], SamplingParams())
    seconds = common.best_of(args.repeat, lambda: hasher(req))  # req.block_hashes stays empty: all blocks each run
    return seconds / num_blocks * 1e6


def bench_hash_block_tokens(args: argparse.Namespace, algo: str) -> float:
    fn = get_hash_fn(algo)
    blocks = [b[: args.block_size] for b in make_prompts(4096, args.block_size, 1)]

    def run() -> None:
        parent = None
        for block in blocks:
            parent = hash_block_tokens(fn, parent, block)

    return common.best_of(args.repeat, run) / len(blocks) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks-per-request", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    print(
        f"block_size={args.block_size}, {args.requests} requests x {args.blocks_per_request} blocks, "
        f"best of {args.repeat}"
    )
    print(f"{'operation':<48}{'us/block':>10}")
    rows = [
        ("allocate + cache + free (miss, evicting)", bench_allocate(args, hit=False)),
        ("lookup + allocate + free (full prefix hit)", bench_allocate(args, hit=True)),
    ]
    for algo in ("sha256", "fast"):
        rows.append((f"request block hasher, {algo}", bench_request_hasher(args, algo)))
        rows.append((f"hash_block_tokens, {algo}", bench_hash_block_tokens(args, algo)))
    for name, us in rows:
        print(f"{name:<48}{us:>10.3f}")


if __name__ == "__main__":
    main()
