"""Does ``--kv-cache-dtype fp8`` pay on this CPU? The decode kernel per cache dtype, end-to-end decode, capacity.

Kernel: one layer's decode attention (``vllite.kernels.cpu_decode``, the path every pure-decode step takes) over
``--num-seqs`` contexts of each ``--contexts`` length in shuffled blocks, with float32, bfloat16 and fp8 (e4m3, e5m2)
caches; the dtypes alternate within each round and the median per-call time of ``--rounds`` rounds is printed.

End to end (``--end-to-end R``): a random-weight model (``--model-preset``, default 30m: 8 layers, 8 heads, 4 KV heads
of 64) generates ``--output-len`` tokens after distinct prompts of ``--prompt-len`` tokens, in fresh processes that
alternate ``--kv-cache-dtype auto`` (float32) and ``fp8``, R rounds. Each process steps the engine through the
prefills until every request has its first token, then times the pure-decode steps that follow (all requests at once,
contexts growing from ``--prompt-len``): decode tokens/s; it also reports the KV blocks ``--cpu-kvcache-space``
holds.

    python benchmarks/bench_kv_cache_dtype.py --contexts 512 1024 2048 --num-seqs 256
    python benchmarks/bench_kv_cache_dtype.py --end-to-end 3 --num-prompts 32 --prompt-len 1024 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def _decode_case(num_seqs: int, ctx: int, kv_heads: int, head_dim: int, block_size: int, seed: int = 0):
    """Block tables over shuffled blocks and float32 K/V caches holding ``num_seqs`` contexts of ``ctx`` tokens."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // block_size)
    num_blocks = num_seqs * per_seq
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(num_seqs, per_seq)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    return tables, torch.full((num_seqs,), ctx, dtype=torch.int32), k, v


def bench_kernel(args: argparse.Namespace) -> dict:
    """Median milliseconds per decode-attention call, per context length and cache dtype."""
    from vllite.kernels.cpu_decode import decode_kernel, paged_decode_attention
    from vllite.kernels.kv_cache_dtype import quantize_kv

    if decode_kernel() is None:
        raise SystemExit("the CPU decode kernel could not be built here")
    results: dict = {}
    heads, kv_heads, head_dim = args.num_heads, args.num_kv_heads, args.head_dim
    for ctx in args.contexts:
        tables, lens, k32, v32 = _decode_case(args.num_seqs, ctx, kv_heads, head_dim, args.block_size)
        caches = {name: (quantize_kv(k32, dt), quantize_kv(v32, dt)) for name, dt in DTYPES.items()}
        del k32, v32
        q32 = torch.randn(args.num_seqs, heads, head_dim)
        times: dict[str, list[float]] = {name: [] for name in DTYPES}
        for _ in range(args.rounds):
            for name, (k, v) in caches.items():
                q = q32.bfloat16() if name == "bfloat16" else q32  # as the engine runs it: the model's dtype
                paged_decode_attention(q, k, v, tables, lens, scale=head_dim**-0.5)  # warm
                start = time.perf_counter()
                for _ in range(args.iters):
                    paged_decode_attention(q, k, v, tables, lens, scale=head_dim**-0.5)
                times[name].append((time.perf_counter() - start) / args.iters * 1e3)
        row = {name: statistics.median(ms) for name, ms in times.items()}
        results[str(ctx)] = row
        mib = {name: k.numel() * k.element_size() * 2 / 2**20 for name, (k, _) in caches.items()}
        cells = "  ".join(f"{name} {row[name]:7.2f} ms ({mib[name]:.0f} MiB)" for name in DTYPES)
        ratio = row["fp8_e4m3"] / row["float32"]
        print(f"{args.num_seqs} seqs x ctx {ctx}:  {cells}  fp8/fp32 {ratio:.2f}x", flush=True)
        del caches
    return results


def _child(args: argparse.Namespace) -> None:
    """One end-to-end run in this process: prints ``RESULT {json}``."""
    import random

    os.environ.setdefault("VLLITE_ENABLE_MULTIPROCESSING", "0")
    from vllite import LLM, SamplingParams
    from vllite.plugins.transformers_executor.kv_cache_sizing import cpu_kvcache_space_bytes, kv_cache_bytes_per_token

    llm = LLM(
        model=args.model,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_seqs=args.num_prompts,
        kv_cache_dtype=args.child,
        cpu_kvcache_space=args.cpu_kvcache_space,
        enable_prefix_caching=False,
    )
    runner = llm.llm_engine.engine_core.engine_core.model_executor.runner
    # What --cpu-kvcache-space holds (the engine allocates at most what max_num_seqs full contexts use, twice).
    s = runner.spec
    per_token = kv_cache_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, runner.kv_cache_dtype.itemsize)
    space_blocks = cpu_kvcache_space_bytes(args.cpu_kvcache_space) // (per_token * runner.block_size)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(args.prompt_len)]} for _ in range(args.num_prompts)
    ]
    warm = [{"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(args.prompt_len)]} for _ in range(2)]
    llm.generate(warm, SamplingParams(max_tokens=4), use_tqdm=False)  # first-call costs of both attention paths
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    # Step through the prefills until every request has its first token, then time the pure-decode steps to the end.
    generated: dict[str, int] = {}  # tokens so far per request (outputs are cumulative)

    def step() -> None:
        for out in engine.step():
            generated[out.request_id] = len(out.outputs[0].token_ids)

    start = time.perf_counter()
    while sum(n > 0 for n in generated.values()) < len(prompts):
        step()
    prefill = time.perf_counter() - start
    before = sum(generated.values())
    decode_start = time.perf_counter()
    while engine.has_unfinished_requests():
        step()
    decode = time.perf_counter() - decode_start
    whole = prefill + decode
    assert all(n == args.output_len for n in generated.values()), generated
    decode_tokens = sum(generated.values()) - before
    print("RESULT " + json.dumps({
        "decode_tokens_per_s": decode_tokens / decode,
        "tokens_per_s": args.num_prompts * args.output_len / whole,
        "prefill_s": prefill,
        "whole_s": whole,
        "num_kv_blocks": runner.num_kv_blocks,
        "space_holds_blocks": space_blocks,
    }), flush=True)  # fmt: skip


def bench_end_to_end(args: argparse.Namespace) -> dict:
    """Alternating fresh processes, ``auto`` (the model's float32) and ``fp8``; the medians of each."""
    sys.path.insert(0, os.path.dirname(__file__))
    import _common as common

    model = common.resolve_model(args.model, args.model_preset)
    runs: dict[str, list[dict]] = {"auto": [], "fp8": []}
    for _ in range(args.end_to_end):
        for kv in runs:
            command = [sys.executable, __file__, "--child", kv, "--model", model]
            for name in ("num_prompts", "prompt_len", "output_len", "cpu_kvcache_space"):
                command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            runs[kv].append(result)
            print(f"  {kv}: {json.dumps(result)}", file=sys.stderr, flush=True)
    summary = {}
    for kv, results in runs.items():
        summary[kv] = {key: statistics.median(r[key] for r in results) for key in results[0]}
        summary[kv]["decode_tokens_per_s_all"] = sorted(r["decode_tokens_per_s"] for r in results)
        s = summary[kv]
        print(
            f"kv-cache-dtype {kv:5}: decode {s['decode_tokens_per_s']:7.1f} tokens/s, whole run "
            f"{s['tokens_per_s']:6.1f} tokens/s, prefill {s['prefill_s']:.1f} s (medians of {len(results)}); "
            f"{args.cpu_kvcache_space} GiB holds {int(s['space_holds_blocks'])} KV blocks of {args.block_size} tokens"
        )
    ratio = summary["fp8"]["decode_tokens_per_s"] / summary["auto"]["decode_tokens_per_s"]
    blocks = summary["fp8"]["space_holds_blocks"] / summary["auto"]["space_holds_blocks"]
    print(f"fp8 / float32 decode: {ratio:.2f}x; KV blocks {blocks:.2f}x")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--end-to-end", type=int, default=0, metavar="R")
    parser.add_argument("--model", default=None)
    parser.add_argument("--model-preset", default="30m")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--cpu-kvcache-space", type=float, default=1.0)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="Write the results here.")
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    results = bench_end_to_end(args) if args.end_to_end else bench_kernel(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
