"""Scheduler overhead per engine step: microseconds for ``schedule()`` + ``update_from_output()`` with N running
decode requests (not a test).

Usage: ``python benchmarks/bench_scheduler.py [--steps 200] [--sizes 64 256 1024] [--repeat 3]``.

Each request has a 32-token prompt and decodes one token per step; the executor is replaced by a prebuilt
``ModelRunnerOutput`` so only scheduler time is measured.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from vllite.policies.continuum import ContinuumScheduler
from vllite.policies.fcfs import FCFSScheduler
from vllite.policies.priority import PriorityScheduler
from vllite.sched import Scheduler
from vllite.sched.output import ModelRunnerOutput
from vllite.testing import make_config, make_request

PROMPT_LEN = 32
BLOCK_SIZE = 16


def bench(cls: type[Scheduler], num_requests: int, steps: int, *, log_stats: bool, caching: bool) -> dict[str, float]:
    max_len = PROMPT_LEN + steps + 8
    config = make_config(
        max_num_batched_tokens=max(2048, num_requests * PROMPT_LEN),
        max_num_seqs=num_requests,
        max_model_len=max_len,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=caching,
    )
    num_blocks = 1 + num_requests * (max_len // BLOCK_SIZE + 2)
    s = cls(config, num_blocks, log_stats=log_stats, step_observer=None)
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 30000 + 10 for j in range(PROMPT_LEN)]
        s.add_request(make_request(s, f"req-{i}", prompt, max_tokens=10_000, priority=i % 3, arrival_time=float(i)))
    req_ids = [f"req-{i}" for i in range(num_requests)]
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
    )
    so = s.schedule()  # the prefill step
    assert len(so.num_scheduled_tokens) == num_requests
    s.update_from_output(so, output)
    # As the engine core does after start-up: long-lived objects leave the cyclic GC's generations.
    gc.collect()
    gc.freeze()
    sched_times: list[float] = []
    update_times: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        so = s.schedule()
        t1 = time.perf_counter()
        s.update_from_output(so, output)
        t2 = time.perf_counter()
        assert so.total_num_scheduled_tokens == num_requests
        sched_times.append(t1 - t0)
        update_times.append(t2 - t1)
    gc.unfreeze()
    total = [a + b for a, b in zip(sched_times, update_times)]
    return {
        "schedule_us": statistics.median(sched_times) * 1e6,
        "update_us": statistics.median(update_times) * 1e6,
        "total_us": statistics.median(total) * 1e6,
        "per_request_us": statistics.median(total) * 1e6 / num_requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sizes", type=int, nargs="*", default=[64, 256, 1024])
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the fastest median is shown")
    args = parser.parse_args()
    print(
        f"{'scheduler':<10} {'stats':<5} {'cache':<5} {'N':>5} {'schedule':>10} {'update':>10} {'total':>10} "
        f"{'per req':>8}  (median µs per step)"
    )
    policies = ((FCFSScheduler, "fcfs"), (PriorityScheduler, "priority"), (ContinuumScheduler, "continuum"))
    for cls, name in policies:
        for log_stats, caching in ((False, True), (True, True), (False, False)):
            if name != "fcfs" and (log_stats or not caching):
                continue
            for n in args.sizes:
                runs = [bench(cls, n, args.steps, log_stats=log_stats, caching=caching) for _ in range(args.repeat)]
                r = min(runs, key=lambda x: x["total_us"])
                print(
                    f"{name:<10} {log_stats!s:<5} {caching!s:<5} {n:>5} {r['schedule_us']:>10.1f} "
                    f"{r['update_us']:>10.1f} {r['total_us']:>10.1f} {r['per_request_us']:>8.2f}"
                )


if __name__ == "__main__":
    main()
