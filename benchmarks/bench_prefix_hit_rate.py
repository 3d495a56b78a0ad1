"""Prefix-cache hit rate of the scheduler on a shared-prefix workload under memory pressure (not a test).

``--groups`` system prompts of ``--prefix-blocks`` blocks each; every request is one of them plus a unique
suffix, and decodes ``--max-tokens`` tokens. Requests arrive ``--arrivals-per-step`` at a time, each naming a
group drawn at random (skewed towards the first groups), and the KV cache holds only ``--num-blocks`` blocks, so
cached prefixes compete with running requests for memory. Prints the cumulative hit rate (hit tokens over
looked-up tokens, counted once per admission) and the number of preemptions.

Run: ``python benchmarks/bench_prefix_hit_rate.py [--requests 400] [--num-blocks 160]``.
"""

from __future__ import annotations

import argparse
import random

import _common as common

from vllite.sched import Scheduler
from vllite.testing import ScriptedModelRunner, make_config, make_request


def make_scheduler(args: argparse.Namespace) -> Scheduler:
    config = make_config(
        max_num_batched_tokens=args.budget,
        max_num_seqs=args.max_num_seqs,
        max_model_len=1024,
        block_size=args.block_size,
        enable_prefix_caching=True,
    )
    return Scheduler(config, args.num_blocks, step_observer=None)


def run(args: argparse.Namespace) -> tuple[float, int, int]:
    rng = random.Random(args.seed)
    s = make_scheduler(args)
    prefix_len = args.prefix_blocks * args.block_size
    prefixes = [[rng.randrange(1, 30000) for _ in range(prefix_len)] for _ in range(args.groups)]
    weights = [1.0 / (g + 1) for g in range(args.groups)]
    ex = ScriptedModelRunner()
    num_added = steps = 0
    while num_added < args.requests or s.get_num_unfinished_requests():
        for _ in range(min(args.arrivals_per_step, args.requests - num_added)):
            prefix = rng.choices(prefixes, weights)[0]
            suffix = [rng.randrange(1, 30000) for _ in range(rng.randint(1, args.max_suffix))]
            s.add_request(make_request(s, f"r{num_added}", prefix + suffix, max_tokens=args.max_tokens))
            num_added += 1
        so = s.schedule()
        s.update_from_output(so, ex.execute(so))
        steps += 1
    return s.kv_cache_manager.prefix_cache_stats.hit_rate, s.num_preemptions_total, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_plain_args(p, requests=400, groups=12, prefix_blocks=8, max_suffix=40, max_tokens=24)  # the workload
    common.add_plain_args(p, block_size=16, num_blocks=160, budget=512, max_num_seqs=16)  # the KV cache and scheduler
    common.add_plain_args(p, arrivals_per_step=2, seed=0)
    args = p.parse_args()
    hit_rate, preemptions, steps = run(args)
    print(f"prefix-cache hit rate {hit_rate:.4f}  preemptions {preemptions}  steps {steps}")


if __name__ == "__main__":
    main()
