"""The benchmark plugin: registers the ``sim`` executor and the ``vllite bench`` command (subcommand ``agent``).

Only this module loads at start-up: the simulator and the trace replay (``sim_executor``, ``traces``,
``agent_bench``, ``agent_report``) are imported when ``--device sim`` or ``vllite bench agent`` runs.

``vllite bench agent`` replays agent traces (``vllite.plugins.bench.traces``) against several schedulers on the same
KV budget, on the simulated executor (virtual time, default), a real model (wall time) or a live server
(``--engine http://HOST:PORT``, wall time, the server's scheduler), and writes ``results.json``, ``results.csv``
and ``jct_vs_load.png``. See ``docs/agent-bench.md``. ``vllite bench serve`` load-tests an OpenAI-compatible
server (``vllite.plugins.bench.serve``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_executors(register: Register) -> None:
    """Registers ``sim`` (SimExecutor): no model, modelled step times on a virtual clock (``--device sim``)."""
    register("sim", "vllite.plugins.bench.sim_executor:SimExecutor")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _engine(text: str) -> str:
    if text in ("sim", "real") or text.startswith(("http://", "https://")):
        return text
    raise argparse.ArgumentTypeError(f"expected sim, real or an http(s)://HOST:PORT server URL, got {text!r}")


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


class AgentBench:
    """``vllite bench agent``: trace replay, JCT / P90 / P95 / jobs/s / hit rate / preemptions / scheduler time."""

    help = "Replay multi-turn agent traces against schedulers (simulated, real engine, or a live server)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--workloads", type=_names, default=["swe"], help="Synthetic presets, comma-separated: swe,bfcl.")
        add("--trace", default=None, help="A JSON-lines trace file instead of a synthetic workload.")
        add("--num-jobs", type=int, default=100, help="Jobs per synthetic workload.")
        add(
            "--token-scale",
            type=float,
            default=1.0,
            help="Multiply the synthetic workloads' token lengths and max context (e.g. 0.03 fits 1024 tokens).",
        )
        add("--jps", type=_floats, default=[0.05], help="Loads in jobs per second, comma-separated.")
        add(
            "--schedulers",
            type=_names,
            default=None,
            help="Registered names or class paths (default fcfs,continuum). With a server: one label for the "
            "scheduler it runs (default: server).",
        )
        add(
            "--engine",
            type=_engine,
            default="sim",
            help="sim (simulated executor, default), real (a model in-process) or a server's http(s)://HOST:PORT.",
        )
        add(
            "--model",
            default=None,
            help="Real engine: model folder (default: the demo model). Server: the model name (default: its first).",
        )
        add(
            "--modes",
            "--mode",
            dest="modes",
            type=_names,
            default=["stateless"],
            help="stateless (each turn a new request with the whole history, default), sessions (each job one "
            "session: turns are input chunks, the engine keeps the KV between them), or both: stateless,sessions. "
            "Sessions need --engine sim or real.",
        )
        add("--vocab-size", type=int, default=None, help="Server: prompt token ids below this (default: demo model).")
        add("--api-key", default=None, help="Server: bearer token (default: $OPENAI_API_KEY, then $VLLITE_API_KEY).")
        add("--num-gpu-blocks", type=int, default=None, help="KV budget in blocks (same for every scheduler).")
        add("--kv-cache-gib", type=float, default=None, help="Sim: simulated KV memory (Llama-8B bytes/token).")
        add("--block-size", type=int, default=16)
        add("--max-num-seqs", type=int, default=128)
        add("--max-num-batched-tokens", type=int, default=2048)
        add("--max-model-len", type=int, default=None, help="Default: fits the trace (>= 32768 on the sim).")
        add("--cost", type=_floats, default=None, help="Sim cost model: FIXED_S,PER_TOKEN_S,PER_CONTEXT_TOKEN_S.")
        add("--cost-profile", default=None, help="Sim: fit the cost model to a step_profile.jsonl.")
        add("--tool-call-estimator", default=None, help="Continuum's estimator (fixed, utility).")
        add("--tool-time-scale", type=float, default=1.0, help="Multiply tool durations (0 = instant tools).")
        add("--seed", type=int, default=0)
        add("--output-dir", default="bench-results/agent", help="Where results.json/.csv and the plot go.")
        add("--write-trace", default=None, help="Also write the synthetic trace(s) here (a folder).")
        add("--no-plot", action="store_true", help="Skip the PNG plot.")

    def run(self, args: argparse.Namespace) -> int:
        from vllite.plugins.bench.agent_report import BenchSettings, run_sweep, speedups, write_report
        from vllite.plugins.bench.agent_sessions import mode_label
        from vllite.plugins.bench.traces import generate_trace, read_trace, trace_stats, write_trace

        if args.trace:
            workloads = {Path(args.trace).stem: read_trace(args.trace)}
        else:
            workloads = {
                name: generate_trace(name, args.num_jobs, seed=args.seed, token_scale=args.token_scale)
                for name in args.workloads
            }
        for name, jobs in workloads.items():
            stats = trace_stats(jobs)
            print(f"{name}: " + ", ".join(f"{k}={v:.6g}" for k, v in stats.items()))
            if args.write_trace:
                write_trace(Path(args.write_trace) / f"{name}.jsonl", jobs)
        cost: dict[str, Any] = {}
        if args.cost:
            if len(args.cost) != 3:
                raise ValueError("--cost takes three numbers: FIXED_S,PER_TOKEN_S,PER_CONTEXT_TOKEN_S.")
            cost = dict(zip(("fixed_s", "per_token_s", "per_context_token_s"), args.cost))
        settings = BenchSettings(
            engine=args.engine,
            model=args.model,
            num_gpu_blocks=args.num_gpu_blocks,
            kv_cache_gib=args.kv_cache_gib,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            cost=cost,
            cost_profile=args.cost_profile,
            tool_call_estimator=args.tool_call_estimator,
            tool_time_scale=args.tool_time_scale,
            seed=args.seed,
            vocab_size=args.vocab_size,
            api_key=args.api_key,
        )
        schedulers = args.schedulers or (["server"] if args.engine not in ("sim", "real") else ["fcfs", "continuum"])
        results = run_sweep(workloads, args.jps, schedulers, settings, modes=args.modes)
        paths = write_report(results, args.output_dir, settings=settings, plot=not args.no_plot)
        for row in speedups([r.summary() for r in results]):
            label = mode_label(row["scheduler"], row["mode"])
            print(
                f"{row['workload']:>6} jps={row['jps']:<7g} {label:>10}: avg JCT {row['jct_speedup']:.2f}x "
                f"lower than fcfs; scheduler time {_ratio(row['sched_time_ratio'])} fcfs's "
                f"(CPU {_ratio(row['sched_cpu_ratio'])}); prompt tokens computed "
                f"{_ratio(row['prompt_tokens_ratio'])} fcfs's"
            )
        for kind, path in paths.items():
            print(f"wrote {kind}: {path}")
        return 0


class ServeBench:
    """``vllite bench serve``: load on an OpenAI-compatible server. Its flags are
    :mod:`vllite.plugins.bench.serve_config` (standard library only); the run, with asyncio and aiohttp,
    is imported only when the command runs."""

    help = "Load-test an OpenAI-compatible server (vllite serve, vLLM): throughput, TTFT, TPOT, ITL, latency."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from vllite.plugins.bench.serve_config import add_bench_arguments

        add_bench_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        from vllite.plugins.bench.serve import run_bench_command

        return run_bench_command(args)


class BenchCommand:
    """``vllite bench``: benchmark subcommands (``agent``, ``serve``)."""

    help = "Benchmarks (agent: multi-turn agent trace replay; serve: load on an OpenAI-compatible server)."

    def __init__(self) -> None:
        self.subcommands: dict[str, AgentBench | ServeBench] = {"agent": AgentBench(), "serve": ServeBench()}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
        for name, command in self.subcommands.items():
            child = sub.add_parser(name, help=command.help, description=command.help)
            command.add_arguments(child)
            child.set_defaults(_bench_run=command.run)

    def run(self, args: argparse.Namespace) -> int:
        return int(args._bench_run(args) or 0)


@hookimpl
def vllite_register_commands(register: Register) -> None:
    """Registers ``bench`` (with the ``agent`` subcommand)."""
    register("bench", BenchCommand())
