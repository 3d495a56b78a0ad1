"""Benchmark the paged-attention kernels.

CPU: the variable-length CPU path (``vllite.kernels.cpu_attention``, the CPU execution path; its plan built
once per step, as a forward pass shares it across layers, and timed separately) against the padded torch
reference and against a dense SDPA peer on the same shapes; the peer gets its K/V already contiguous and its
masks prebuilt, so ``fast/sdpa`` is the cost of paging. The shapes include a mixed-length decode batch
(64 sequences, contexts 16..800), a uniform decode batch, prefills and mixes. CUDA (when present): the Triton
kernel against the reference and against the same dense SDPA peer.

    python benchmarks/bench_kernels.py [--threads N] [--iters N]
    python benchmarks/bench_kernels.py --end-to-end 3 [--model-preset 30m] [--num-prompts 64]

``--end-to-end R`` instead runs a mixed-length offline workload (prompts of 8-400 tokens, 16-384 new tokens each,
greedy, fp32) through the engine R times with the fast path and R times with ``VLLITE_CPU_ATTENTION=reference``,
alternating fresh processes, and prints the median tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import _common as common
import torch
import torch.nn.functional as F

from vllite.kernels import PagedAttentionParams
from vllite.kernels.cpu_attention import paged_attention_cpu
from vllite.kernels.cpu_plan import plan_paged_attention_cpu
from vllite.kernels.reference import paged_attention_ref

# name -> list of (context_len, query_len) per sequence
SHAPES: dict[str, list[tuple[int, int]]] = {
    "decode 64x ctx16..800": [(16 + (784 * i) // 63, 1) for i in range(64)],
    "decode 32x ctx512": [(512, 1)] * 32,
    "verify 32x(ctx16..800+4)": [(16 + (784 * i) // 31, 4) for i in range(32)],
    "prefill 4x256": [(0, 256)] * 4,
    "chunked 2x(ctx256+128)": [(256, 128)] * 2,
    "mixed 16 decode + 1x256": [(384, 1)] * 16 + [(0, 256)],
}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 4, 64, 16


def build(specs: list[tuple[int, int]], device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """A paged batch (shuffled blocks) plus dense per-group K/V, queries and masks for the SDPA peer."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in specs]
    nblk = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(nblk)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(specs), max(nblk), dtype=torch.int32)
    used = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[used : used + n].to(torch.int32)
        used += n
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    q_lens = [q for _, q in specs]
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    qsl = torch.tensor([0, *q_lens]).cumsum(0).to(device=device, dtype=torch.int32)
    params = PagedAttentionParams(
        tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        qsl,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        scale=HEAD_DIM**-0.5,
    )
    # Dense peer: one SDPA per group of equal query length, K/V contiguous [S, Hkv, L, D], mask prebuilt.
    peer = []
    for ql in sorted(set(q_lens)):
        idx = [s for s, q in enumerate(q_lens) if q == ql]
        length = max(seq_lens[s] for s in idx)
        pos = torch.arange(length)
        blk = tables[idx][:, (pos // BLOCK_SIZE).clamp(max=tables.shape[1] - 1)].long().to(device)
        off = (pos % BLOCK_SIZE).to(device).expand(len(idx), -1)
        k = k_cache[blk, off].transpose(1, 2).contiguous()
        v = v_cache[blk, off].transpose(1, 2).contiguous()
        starts = [int(qsl[s]) for s in idx]
        q = torch.stack([query[a : a + ql] for a in starts]).transpose(1, 2).contiguous()
        lens = torch.tensor([seq_lens[s] for s in idx])
        qpos = (lens - ql)[:, None] + torch.arange(ql)
        mask = (pos[None, None] <= qpos[:, :, None]) & (pos[None, None] < lens[:, None, None])
        peer.append((q, k, v, mask[:, None].to(device)))
    return dict(paged=(query, k_cache, v_cache, params), peer=peer)


def sdpa_peer(peer: list) -> None:
    for q, k, v, mask in peer:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True)


def timeit(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Median milliseconds per call after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def mixed_workload(num_prompts: int, preset: str | None) -> float:
    """One engine over the mixed-length workload in this process; returns generated tokens/s."""
    import random

    from vllite import LLM

    llm = LLM(common.resolve_model(None, preset), dtype="float32")
    rng = random.Random(0)
    reqs = [
        ([rng.randint(5, 4000) for _ in range(rng.randint(8, 400))], rng.randint(16, 384)) for _ in range(num_prompts)
    ]
    common.warm_up(llm)
    elapsed, _ = common.timed_generate(llm, reqs)
    return sum(n for _, n in reqs) / elapsed


def end_to_end(rounds: int, num_prompts: int, preset: str | None) -> None:
    """Alternate fresh processes with the fast path and the reference; print medians and the ratio."""
    rates: dict[str, list[float]] = {"fast": [], "reference": []}
    for _ in range(rounds):
        for mode in rates:
            env = dict(os.environ, VLLITE_CPU_ATTENTION="fast" if mode == "fast" else "reference")
            cmd = [sys.executable, __file__, "--worker", "--num-prompts", str(num_prompts)]
            cmd += ["--model-preset", preset] if preset else []
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            rates[mode].append(json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"])
            print(f"{mode:9} {rates[mode][-1]:9.1f} tokens/s", flush=True)
    fast, ref = statistics.median(rates["fast"]), statistics.median(rates["reference"])
    print(f"median: fast {fast:.1f}, reference {ref:.1f} tokens/s; fast / reference {fast / ref:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--end-to-end", type=int, default=0, metavar="ROUNDS")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--model-preset", default=None, help="vllite.testing preset (default: the demo model)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    common.print_cpu()
    if ns.worker:
        print(json.dumps({"tokens_per_s": mixed_workload(ns.num_prompts, ns.model_preset)}))
        return
    if ns.end_to_end:
        end_to_end(ns.end_to_end, ns.num_prompts, ns.model_preset)
        return
    torch.set_num_threads(ns.threads)
    print(f"H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}, torch threads={ns.threads}")

    print("\nCPU float32: variable-length CPU path vs padded reference vs dense SDPA peer (median ms per layer)")
    print(f"{'shape':28} {'fast':>8} {'plan':>7} {'ref':>8} {'sdpa':>8} {'ref/fast':>8} {'fast/sdpa':>9}")
    for name, specs in SHAPES.items():
        case = build(specs, "cpu", torch.float32)
        query, k_cache, v_cache, params = case["paged"]
        metadata = (params.block_tables, params.seq_lens, params.query_start_loc)
        dims = dict(block_size=BLOCK_SIZE, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
        planned = dataclasses.replace(params, plan=plan_paged_attention_cpu(*metadata, **dims))
        fast_args, ref_args = (query, k_cache, v_cache, planned), case["paged"]
        torch.testing.assert_close(paged_attention_cpu(*fast_args), paged_attention_ref(*ref_args))
        t_plan = timeit(lambda a=metadata, d=dims: plan_paged_attention_cpu(*a, **d), ns.iters, False)
        t_fast = timeit(lambda a=fast_args: paged_attention_cpu(*a), ns.iters, False)
        t_ref = timeit(lambda a=ref_args: paged_attention_ref(*a), ns.iters, False)
        t_peer = timeit(lambda c=case: sdpa_peer(c["peer"]), ns.iters, False)
        print(
            f"{name:28} {t_fast:8.2f} {t_plan:7.2f} {t_ref:8.2f} {t_peer:8.2f} {t_ref / t_fast:8.2f} "
            f"{t_fast / t_peer:9.2f}"
        )

    if not torch.cuda.is_available():
        print("\nno CUDA device: skipping the Triton benchmark")
        return
    from vllite.kernels.triton_attention import paged_attention_triton

    for dtype in (torch.float16, torch.bfloat16):
        print(f"\nCUDA {dtype}: Triton vs reference vs dense SDPA peer (median ms)")
        print(f"{'shape':28} {'triton':>9} {'ref':>9} {'sdpa':>9} {'ref/tri':>8} {'tri/sdpa':>8}")
        for name, specs in SHAPES.items():
            case = build(specs, "cuda", dtype)
            p = case["paged"]
            t_tri = timeit(lambda p=p: paged_attention_triton(*p), 10 * ns.iters, True)
            t_ref = timeit(lambda p=p: paged_attention_ref(*p), 10 * ns.iters, True)
            t_peer = timeit(lambda c=case: sdpa_peer(c["peer"]), 10 * ns.iters, True)
            ratios = f"{t_ref / t_tri:8.2f} {t_tri / t_peer:8.2f}"
            print(f"{name:28} {t_tri:9.3f} {t_ref:9.3f} {t_peer:9.3f} {ratios}")


if __name__ == "__main__":
    main()
