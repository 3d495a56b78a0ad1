"""Data-parallel scaling: offline throughput of ``-dp 2`` (or any ``--dp-sizes``) vs ``-dp 1`` on the same machine.

    python benchmarks/bench_data_parallel.py                          # demo model, mixed workload, dp 1 vs 2
    python benchmarks/bench_data_parallel.py --model-preset 30m --num-prompts 128
    python benchmarks/bench_data_parallel.py --backend ray            # dp 2 as Ray actors on 2 local Ray nodes

Every engine runs one torch thread (``VLLITE_CPU_NUM_THREADS=1`` unless set) on its own CPU: with the default
``VLLITE_CPU_OMP_THREADS_BIND=auto`` the data-parallel client gives rank *r* CPU *r* of the affinity mask, so
``-dp 1`` computes on one core and ``-dp 2`` on two. The workload is ``bench_throughput.py``'s (``--workload
mixed``: prompts of 8 to 400 tokens, 16 to 384 new tokens each, greedy, EOS ignored). Each configuration runs in
a worker process of its own (its frontend placed as it would be alone); all stay loaded and alternate for
``--repeats`` rounds (prefix caches reset before each); medians are reported, with the ratio of each to ``-dp 1``
(target on a 2-core machine: >= 1.7x for ``-dp 2``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common
from bench_throughput import make_workload


class DPRunner(common.LineChild):
    """An ``LLM`` with ``data_parallel_size`` engines in a worker process of its own (so each configuration's
    frontend and engines are placed on the CPUs as they would be alone), timed over repeated rounds."""

    name = "the dp worker"

    def __init__(self, dp_size: int, argv: list[str]) -> None:
        super().__init__([sys.executable, __file__, *argv, "--worker-dp", str(dp_size)])
        self.expect("ready")

    def __call__(self) -> float:
        self.send("run")
        return float(self.expect("elapsed"))

    def close(self, timeout: float = 120) -> None:
        """Stops the worker (and its engines)."""
        super().close(timeout)


def worker(model: str, workload: common.Workload, args: argparse.Namespace) -> None:
    """The worker process: loads the engine, then times one round per ``run`` line on stdin."""
    from vllite import LLM

    llm = LLM(
        model, **common.engine_kwargs(args), data_parallel_size=args.worker_dp, data_parallel_backend=args.backend
    )
    common.warm_up(llm)
    print("ready 1", flush=True)
    try:
        for _ in sys.stdin:
            llm.reset_prefix_cache()
            print(f"elapsed {common.timed_generate(llm, workload)[0]}", flush=True)
    finally:
        llm.shutdown()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(parser, "Build a random-weight model (e.g. 30m).")
    parser.add_argument("--dp-sizes", default="1,2", help="Comma-separated data-parallel sizes; the first is the base.")
    parser.add_argument("--backend", default="mp", help="data_parallel_backend: mp (local processes) or ray.")
    parser.add_argument(
        "--ray-local-nodes",
        type=int,
        default=2,
        help="ray: start a Ray cluster of this many local nodes of one CPU each (0: use RAY_ADDRESS or start one).",
    )
    common.add_workload_args(parser, workload="mixed", uniform_help=True)
    common.add_engine_args(parser)
    common.add_repeat_args(parser, "Alternating rounds per configuration.")
    common.add_json_arg(parser)
    parser.add_argument("--worker-dp", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def start_ray_cluster(num_nodes: int):
    """A local Ray cluster of ``num_nodes`` nodes of one CPU each, which the workers join (``RAY_ADDRESS``)."""
    from ray.cluster_utils import Cluster

    # Ray kills workers when the machine's memory runs high (other processes count): not on a benchmark.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(num_nodes - 1):
        cluster.add_node(num_cpus=1)
    os.environ["RAY_ADDRESS"] = cluster.address
    return cluster


def main() -> None:
    """Runs the comparison and prints the medians and ratios."""
    args = parse_args()
    os.environ.setdefault("VLLITE_CPU_NUM_THREADS", "1")
    os.environ.setdefault("VLLITE_ENABLE_MULTIPROCESSING", "1")
    from vllite.engine.tokenizer import get_tokenizer

    model = common.resolve_model(args.model, args.model_preset if args.worker_dp is None else None)
    workload = make_workload(get_tokenizer(model), args)
    if args.worker_dp is not None:
        worker(model, workload, args)
        return
    total = sum(n for _, n in workload)
    sizes = [int(size) for size in args.dp_sizes.split(",")]
    argv = sys.argv[1:]
    if args.model_preset:  # the workers load the model built here
        argv += ["--model", model, "--model-preset", ""]
    runners: dict[int, DPRunner] = {}
    cluster = start_ray_cluster(args.ray_local_nodes) if args.backend == "ray" and args.ray_local_nodes > 0 else None
    try:
        for size in sizes:
            runners[size] = DPRunner(size, argv)
        rates = common.alternate(runners, args.repeats, total, label=lambda size: f"dp {size}")
    finally:
        for runner in runners.values():
            runner.close()
        if cluster is not None:
            cluster.shutdown()
    results: dict = {"model": model, "backend": args.backend, "workload": args.workload, "new_tokens": total}
    medians = {
        size: common.report_rates(results, f"dp{size}", f"dp {size} ({args.backend})", rates[size]) for size in sizes
    }
    base = sizes[0]
    for size in sizes[1:]:
        results[f"ratio_dp{size}_vs_dp{base}"] = medians[size] / medians[base]
        print(f"ratio dp {size} / dp {base}: {medians[size] / medians[base]:.2f}x")
    common.write_json(args.json, results)


if __name__ == "__main__":
    main()
