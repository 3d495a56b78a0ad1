"""Noisy neighbour: offline throughput quiet, then with an unrelated busy process pinned to one core.

    python benchmarks/bench_noisy_neighbour.py                      # vllite, and vLLM if /tmp/vllm-venv has it
    python benchmarks/bench_noisy_neighbour.py --engines vllite --rounds 5 --busy-cores 0
    python benchmarks/bench_noisy_neighbour.py --vllm-python /path/to/venv/bin/python

Each engine loads once, in a worker process of its own (vLLM's from ``--vllm-python``), and generates the same
prompts (``bench_throughput.make_prompts``; exactly ``--output-len`` tokens each, EOS ignored). Rounds alternate
engines and conditions: quiet, then with ``python -c 'while True: pass'`` pinned to each core of
``--busy-cores`` in turn (default: every core the benchmark may use). The kept fraction is the median noisy
throughput over the median quiet one, per engine and per busy core; the acceptance target of issue 17 is that
vllite keeps at least 45% of its quiet throughput on a 2-core machine.
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

import _common as common

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM_PYTHON = "/tmp/vllm-venv/bin/python"
# Named vllite configurations (environment of the worker): the default, threads left alone, and the engine in the
# caller's process.
VARIANTS = {
    "vllite": {},
    "vllite-nobind": {"VLLITE_CPU_OMP_THREADS_BIND": "nobind"},
    "vllite-inprocess": {"VLLITE_ENABLE_MULTIPROCESSING": "0"},
}


# ---------------------------------------------------------------------------------------------- worker side
def _vllite_engine(model: str, args: dict):
    sys.path.insert(0, str(HERE))
    from bench_throughput import VlliteRunner

    runner = VlliteRunner(model, argparse.Namespace(**args))

    def run(prompts: list[list[int]], output_len: int) -> float:
        return runner([(p, output_len) for p in prompts], argparse.Namespace(**args))

    return run


def _vllm_engine(model: str, args: dict):
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    llm = LLM(
        model,
        **common.engine_kwargs(argparse.Namespace(**args)),
        enable_prefix_caching=False,
        gpu_memory_utilization=0.25,  # on CPU: the share of RAM for the KV cache (its default, 0.92, fails to start)
    )

    def run(prompts: list[list[int]], output_len: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * output_len
        return elapsed

    return run


def worker_main(engine: str) -> None:
    """Loads one engine, answers ``READY``, then times one round per request line (JSON in, ``ELAPSED s`` out)."""
    setup = json.loads(sys.stdin.readline())
    make = _vllm_engine if engine == "vllm" else _vllite_engine
    run = make(setup["model"], setup["args"])
    print("READY", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print("ELAPSED", run(job["prompts"], job["output_len"]), flush=True)


# ---------------------------------------------------------------------------------------------- driver side
class Worker(common.LineChild):
    """One engine in its own process, driven line by line."""

    def __init__(self, engine: str, python: str, model: str, args: argparse.Namespace, env: dict[str, str]) -> None:
        self.engine = engine
        self.name = f"the {engine} worker"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), **env)
        super().__init__([python, str(Path(__file__).resolve()), "--worker", engine], env=env)
        keys = ("dtype", "max_num_seqs", "max_num_batched_tokens", "quiet")
        self.send(json.dumps({"model": model, "args": {k: getattr(args, k) for k in keys}}))
        self.expect("READY")

    def run(self, prompts: list[list[int]], output_len: int) -> float:
        self.send(json.dumps({"prompts": prompts, "output_len": output_len}))
        return float(self.expect("ELAPSED"))


def start_busy_process(core: int) -> subprocess.Popen:
    """An unrelated process spinning on ``core``."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(proc.pid, {core})
    return proc


def run_rounds(workers: list[Worker], prompts: list[list[int]], args: argparse.Namespace, busy_cores: list[int]):
    """Alternating quiet and noisy rounds; returns {engine: {"quiet": [tok/s], core: [tok/s], ...}}."""
    total = len(prompts) * args.output_len
    rates: dict[str, dict[str, list[float]]] = {w.engine: {} for w in workers}
    for round_index in range(args.rounds):
        conditions: list[int | None] = [None, *busy_cores]  # None: quiet
        for condition in conditions:
            for worker in workers:
                busy = start_busy_process(condition) if condition is not None else None
                try:
                    if busy is not None:
                        time.sleep(args.settle_s)  # the neighbour is running before the round starts
                    elapsed = worker.run(prompts, args.output_len)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
                key = "quiet" if condition is None else f"busy core {condition}"
                rates[worker.engine].setdefault(key, []).append(total / elapsed)
                print(f"round {round_index + 1} {worker.engine:16s} {key:12s} {total / elapsed:9.1f} tok/s", flush=True)
    return rates


def summarize(rates: dict[str, dict[str, list[float]]]) -> dict:
    """Medians and kept fractions (noisy median / quiet median) per engine and busy core."""
    summary: dict = {}
    for engine, by_condition in rates.items():
        quiet = statistics.median(by_condition["quiet"])
        entry: dict = {"quiet_tokens_per_s": quiet, "all": by_condition}
        kept = {}
        for key, values in by_condition.items():
            if key != "quiet":
                kept[key] = statistics.median(values) / quiet
        entry["kept"] = kept
        entry["kept_worst"] = min(kept.values()) if kept else None
        entry["kept_mean"] = statistics.mean(kept.values()) if kept else None
        summary[engine] = entry
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    common.add_model_args(parser, "A random-weight model from vllite.testing (e.g. 30m).")
    parser.add_argument(
        "--engines", default="vllite,vllm", help=f"Comma-separated: {', '.join(VARIANTS)}, vllm, or --variant names."
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:KEY=VALUE,KEY=VALUE: one more vllite configuration, e.g. 'vllite-2t:VLLITE_CPU_NUM_THREADS=2'.",
    )
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="The python that has vLLM installed.")
    common.add_workload_args(parser, num_prompts=64, output_len=64)
    common.add_engine_args(parser, max_model_len=False)
    parser.add_argument("--busy-cores", default=None, help="Cores for the busy process, e.g. '0,1' (default: all).")
    parser.add_argument("--settle-s", type=float, default=1.0, help="Seconds the neighbour runs before a round.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", default=True, help=argparse.SUPPRESS)
    common.add_json_arg(parser)
    return parser


def select_engines(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[str], dict]:
    """The engines of ``--engines`` (vLLM left out where ``--vllm-python`` does not exist) and the vllite
    configurations, ``--variant``'s added to the named ones."""
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "vllm" in engines and not Path(args.vllm_python).exists():
        print(f"vLLM skipped: {args.vllm_python} does not exist (--vllm-python)")
        engines.remove("vllm")
    variants = dict(VARIANTS)
    for spec in args.variant:
        name, _, assignments = spec.partition(":")
        variants[name] = dict(item.split("=", 1) for item in assignments.split(",") if item)
    unknown = [e for e in engines if e != "vllm" and e not in variants]
    if unknown:
        parser.error(f"unknown engine(s) {unknown}; known: {', '.join(variants)}, vllm")
    return engines, variants


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker)
        return

    sys.path.insert(0, str(HERE))
    from bench_throughput import make_prompts

    from vllite.engine.tokenizer import get_tokenizer

    model = common.resolve_model(args.model, args.model_preset)
    prompts = make_prompts(get_tokenizer(model), args.num_prompts, args.input_len, args.seed)
    cores = sorted(os.sched_getaffinity(0))
    busy_cores = [int(c) for c in args.busy_cores.split(",")] if args.busy_cores else cores
    engines, variants = select_engines(args, parser)

    workers = []
    try:
        for engine in engines:
            python = args.vllm_python if engine == "vllm" else sys.executable
            try:
                workers.append(Worker(engine, python, model, args, variants.get(engine, {})))
            except RuntimeError as exc:
                print(f"{engine} skipped: {exc}")
        rates = run_rounds(workers, prompts, args, busy_cores)
    finally:
        for worker in workers:
            worker.close()
    summary = summarize(rates)
    print(f"\n{len(cores)} cores, busy process on core(s) {busy_cores}, {args.rounds} rounds, medians:")
    for engine, entry in summary.items():
        kept = ", ".join(f"{k}: {v:.0%}" for k, v in entry["kept"].items())
        print(
            f"{engine:16s} quiet {entry['quiet_tokens_per_s']:8.1f} tok/s; kept {kept}; "
            f"worst {entry['kept_worst']:.0%}, mean {entry['kept_mean']:.0%}"
        )
    common.write_json(args.json, {"model": model, "cores": cores, "busy_cores": busy_cores, "engines": summary})


if __name__ == "__main__":
    main()
