"""This machine's matmul peak: the figure the decode throughput is compared with (issue 29).

    python benchmarks/bench_matmul_peak.py                 # bfloat16 and float32, torch's threads
    python benchmarks/bench_matmul_peak.py --threads 2 --sizes 2048 4096

Times torch's square matmul (``n x n`` by ``n x n``, ``2 n^3`` flops) and ``F.linear`` at a decode batch's shape
(``--rows`` rows against each weight of a Llama layer of ``--hidden`` / ``--intermediate``): best of ``--repeats``
after a warm-up, in GFLOP/s. The best square figure is the peak a throughput run's FLOP rate is a share of.
"""

from __future__ import annotations

import argparse
from functools import partial

import _common as common
import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    common.print_cpu()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        peak = 0.0
        for n in args.sizes:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            rate = 2 * n**3 / common.best_of(args.repeats, partial(torch.matmul, a, b), warmup=3) / 1e9
            peak = max(peak, rate)
            print(f"{name:9s} matmul {n}^3: {rate:7.0f} GFLOP/s")
        h, i = args.hidden, args.intermediate
        for k, n in ((h, i), (i, h), (h, h)):
            x, w = torch.randn(args.rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            rate = 2 * args.rows * k * n / common.best_of(4 * args.repeats, partial(F.linear, x, w), warmup=3) / 1e9
            print(f"{name:9s} linear {args.rows}x{k} by {n}x{k}: {rate:7.0f} GFLOP/s")
        print(f"{name:9s} peak (best square matmul): {peak:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
