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
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_throughput import Workload, make_workload


class DPRunner:
    """An ``LLM`` with ``data_parallel_size`` engines in a worker process of its own (so each configuration's
    frontend and engines are placed on the CPUs as they would be alone), timed over repeated rounds."""

    def __init__(self, dp_size: int, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *argv, "--worker-dp", str(dp_size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._expect("ready")

    def _expect(self, tag: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return line.split(" ", 1)[1].strip()
        raise RuntimeError(f"the dp worker exited (code {self.proc.wait()}) before answering {tag!r}")

    def __call__(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return float(self._expect("elapsed"))

    def close(self) -> None:
        """Stops the worker (and its engines)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def worker(model: str, workload: Workload, args: argparse.Namespace) -> None:
    """The worker process: loads the engine, then times one round per ``run`` line on stdin."""
    from vllite import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        data_parallel_size=args.worker_dp,
        data_parallel_backend=args.backend,
    )
    llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    print("ready 1", flush=True)
    try:
        for _ in sys.stdin:
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p, _ in workload], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in workload]
            print(f"elapsed {elapsed}", flush=True)
    finally:
        llm.shutdown()


def main() -> None:
    """Runs the comparison and prints the medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model folder (default: the demo model).")
    parser.add_argument("--model-preset", default=None, help="Build a random-weight model (e.g. 30m).")
    parser.add_argument("--dp-sizes", default="1,2", help="Comma-separated data-parallel sizes; the first is the base.")
    parser.add_argument("--backend", default="mp", help="data_parallel_backend: mp (local processes) or ray.")
    parser.add_argument(
        "--ray-local-nodes",
        type=int,
        default=2,
        help="ray: start a Ray cluster of this many local nodes of one CPU each (0: use RAY_ADDRESS or start one).",
    )
    parser.add_argument("--workload", choices=["uniform", "mixed"], default="mixed")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64, help="uniform: the longest prompt.")
    parser.add_argument("--output-len", type=int, default=128, help="uniform: new tokens per prompt.")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="Alternating rounds per configuration.")
    parser.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    parser.add_argument("--worker-dp", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    os.environ.setdefault("VLLITE_CPU_NUM_THREADS", "1")
    os.environ.setdefault("VLLITE_ENABLE_MULTIPROCESSING", "1")
    from vllite.assets import default_model_path
    from vllite.engine.tokenizer import get_tokenizer

    model = args.model
    if args.model_preset and args.worker_dp is None:
        import tempfile

        from vllite.testing import make_model

        model = str(make_model(preset=args.model_preset, path=tempfile.mkdtemp(prefix="vllite-bench-")))
    model = str(model or default_model_path())
    workload = make_workload(get_tokenizer(model), args)
    if args.worker_dp is not None:
        worker(model, workload, args)
        return
    total = sum(n for _, n in workload)
    sizes = [int(size) for size in args.dp_sizes.split(",")]
    argv = [arg for arg in sys.argv[1:]]
    if args.model_preset:  # the workers load the model built here
        argv += ["--model", model, "--model-preset", ""]
    runners: dict[int, DPRunner] = {}
    times: dict[int, list[float]] = {size: [] for size in sizes}
    cluster = None
    if args.backend == "ray" and args.ray_local_nodes > 0:
        from ray.cluster_utils import Cluster

        # Ray kills workers when the machine's memory runs high (other processes count): not on a benchmark.
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(args.ray_local_nodes - 1):
            cluster.add_node(num_cpus=1)
        os.environ["RAY_ADDRESS"] = cluster.address  # the workers join it
    try:
        for size in sizes:
            runners[size] = DPRunner(size, argv)
        for _ in range(args.repeats):
            for size, runner in runners.items():
                times[size].append(runner())
                print(f"  dp {size}: {total / times[size][-1]:.1f} tokens/s", file=sys.stderr, flush=True)
    finally:
        for runner in runners.values():
            runner.close()
        if cluster is not None:
            cluster.shutdown()
    results: dict = {"model": model, "backend": args.backend, "workload": args.workload, "new_tokens": total}
    base = sizes[0]
    medians = {size: statistics.median(total / t for t in times[size]) for size in sizes}
    for size in sizes:
        rates = sorted(total / t for t in times[size])
        results[f"dp{size}_tokens_per_s"] = medians[size]
        results[f"dp{size}_tokens_per_s_all"] = rates
        print(
            f"dp {size} ({args.backend}) {medians[size]:10.1f} generated tokens/s (median of {len(rates)}: "
            + ", ".join(f"{r:.0f}" for r in rates)
            + ")"
        )
    for size in sizes[1:]:
        results[f"ratio_dp{size}_vs_dp{base}"] = medians[size] / medians[base]
        print(f"ratio dp {size} / dp {base}: {medians[size] / medians[base]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
