"""Sweeps of agent-trace replays and their report.

:func:`run_sweep` replays every (workload, load, scheduler) on the same KV budget (:class:`BenchSettings`) with
:func:`run_one`, which collects a :class:`RunResult` per replay; :func:`write_report` writes ``results.json``,
``results.csv`` (one :meth:`RunResult.summary` row per replay, with :func:`speedups` against FCFS), the measured
step profile of real-engine runs and ``jct_vs_load.png`` (:func:`plot_jct`). The replay itself (event loop and
backends) is :mod:`vllite.plugins.bench.agent_bench`; a live server (``engine`` an ``http(s)://`` URL) is
:mod:`vllite.plugins.bench.agent_http`, whose figures the server does not export are ``None`` in the rows. Each replay
runs in a mode (``stateless``: each turn a new request; ``sessions``: each job one session,
:mod:`vllite.plugins.bench.agent_sessions`); speed-ups are against stateless FCFS.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllite.plugins.bench.agent_bench import RealBackend, SimBackend, replay
from vllite.plugins.bench.agent_http import HttpBackend, is_http_engine
from vllite.plugins.bench.agent_sessions import RealSessionBackend, SimSessionBackend, check_mode, mode_label
from vllite.plugins.bench.traces import Job

logger = logging.getLogger(__name__)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# ---------------------------------------------------------------------------------------------- results
@dataclass
class RunResult:
    """One replay: per-job completion times and the engine's figures (``None``: not visible to the backend)."""

    scheduler: str
    workload: str
    jobs_per_s: float
    jct_s: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    num_jobs: int = 0
    num_requests: int = 0
    prefix_hit_rate: float | None = 0.0
    preemptions: int | None = 0
    steps: int | None = 0
    sched_ms_per_step: float | None = 0.0
    sched_cpu_ms_per_step: float | None = 0.0
    wall_s: float = 0.0
    num_gpu_blocks: int | None = 0
    profile: list[dict[str, float]] = field(default_factory=list)  # real engine: measured step times
    mode: str = "stateless"  # "stateless" (a request per turn) or "sessions" (a session per job)
    prompt_tokens_computed: int | None = None  # sum over turns of context - cached tokens (None: not visible)
    tokens_scheduled: int | None = None  # every token the steps computed (prefill, recomputation, decode)

    def summary(self) -> dict[str, Any]:
        """The report row: average / P50 / P90 / P95 JCT, throughput, cache and scheduler figures."""
        jct = self.jct_s
        return {
            "workload": self.workload,
            "scheduler": self.scheduler,
            "mode": self.mode,
            "jps": self.jobs_per_s,
            "jobs": self.num_jobs,
            "completed": len(jct),
            "avg_jct_s": sum(jct) / len(jct) if jct else 0.0,
            "p50_jct_s": percentile(jct, 50),
            "p90_jct_s": percentile(jct, 90),
            "p95_jct_s": percentile(jct, 95),
            "makespan_s": self.makespan_s,
            "throughput_jobs_per_s": len(jct) / self.makespan_s if self.makespan_s > 0 else 0.0,
            "prefix_hit_rate": self.prefix_hit_rate,
            "preemptions": self.preemptions,
            "steps": self.steps,
            "sched_ms_per_step": self.sched_ms_per_step,
            "sched_cpu_ms_per_step": self.sched_cpu_ms_per_step,
            "num_gpu_blocks": self.num_gpu_blocks,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "tokens_scheduled": self.tokens_scheduled,
            "wall_s": self.wall_s,
        }


def _engine_figures(backend: SimBackend | RealBackend) -> dict[str, Any]:
    """Prefix-cache hit rate, preemptions and scheduler time of an in-process engine since its warm-up."""
    sched = backend.scheduler
    stats = sched.kv_cache_manager.prefix_cache_stats
    queries, hits = stats.queries - backend.hit_baseline[0], stats.hits - backend.hit_baseline[1]
    return {
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "preemptions": sched.num_preemptions_total,
        "steps": backend.timer.steps,
        "sched_ms_per_step": backend.timer.ms_per_step,
        "sched_cpu_ms_per_step": backend.timer.cpu_ms_per_step,
        "prompt_tokens_computed": backend.prompt_tokens_computed,
        "tokens_scheduled": backend.timer.tokens,
    }


def run_one(
    jobs: Sequence[Job],
    arrivals: Sequence[float],
    backend: SimBackend | RealBackend | HttpBackend,
    *,
    scheduler: str,
    workload: str,
    jobs_per_s: float,
    tool_time_scale: float = 1.0,
    seed: int = 0,
    mode: str = "stateless",
) -> RunResult:
    """Replays and collects a :class:`RunResult`; shuts the backend down."""
    wall = time.perf_counter()
    try:
        jct, makespan = replay(jobs, arrivals, backend, tool_time_scale=tool_time_scale, seed=seed)
        figures = backend.engine_figures() if isinstance(backend, HttpBackend) else _engine_figures(backend)
        return RunResult(
            scheduler=scheduler,
            workload=workload,
            jobs_per_s=jobs_per_s,
            jct_s=jct,
            makespan_s=makespan,
            num_jobs=len(jobs),
            num_requests=sum(len(j.turns) for j in jobs),
            wall_s=time.perf_counter() - wall,
            **figures,
            num_gpu_blocks=backend.num_gpu_blocks,
            mode=mode,
        )
    finally:
        backend.shutdown()


# ---------------------------------------------------------------------------------------------- sweeps
@dataclass
class BenchSettings:
    """One benchmark: the engine shape and KV budget every scheduler gets, and how to replay."""

    engine: str = "sim"  # "sim" (virtual time), "real" (a model, wall time) or a server's http(s):// URL
    model: str | None = None  # real engine: model folder (default: the demo model); server: the model's name
    num_gpu_blocks: int | None = None  # KV budget in blocks; None = kv_cache_gib (sim) / measured (real)
    kv_cache_gib: float | None = None  # sim: simulated KV memory
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: fits the trace (at least 32768 on the sim)
    cost: dict[str, float] = field(default_factory=dict)  # sim: CostModel fields
    cost_profile: str | None = None  # sim: JSON-lines step profile to fit the cost model to
    tool_call_estimator: str | None = None
    tool_time_scale: float = 1.0
    seed: int = 0
    vocab_size: int | None = None  # server: random prompt token ids below this (default: the demo model's)
    api_key: str | None = field(default=None, repr=False)  # server: bearer token (never written to the report)


def _engine_args(settings: BenchSettings, scheduler: str, max_model_len: int, **engine: Any) -> Any:
    """The ``EngineArgs`` every run shares (shape, KV budget, scheduler, seed), plus the backend's ``engine``."""
    from vllite.engine_args import EngineArgs

    args = EngineArgs(
        block_size=settings.block_size,
        num_gpu_blocks_override=settings.num_gpu_blocks,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len or max_model_len,
        scheduler_cls=scheduler,
        seed=settings.seed,
        **engine,
    )
    if settings.tool_call_estimator:
        args.tool_call_estimator = settings.tool_call_estimator
    return args


def make_sim_config(settings: BenchSettings, scheduler: str, max_context: int) -> Any:
    """The ``EngineConfig`` of one simulated run (fresh virtual clock, same KV budget for every scheduler)."""
    from vllite.plugins.bench.sim_executor import DEFAULT_MAX_MODEL_LEN

    args = _engine_args(
        settings,
        scheduler,
        max(DEFAULT_MAX_MODEL_LEN, max_context),
        model="sim",
        skip_tokenizer_init=True,
        device="sim",
        executor="sim",
        prefix_caching_hash_algo="fast",
    )
    sim: dict[str, Any] = {"cost": dict(settings.cost), "seed": settings.seed}
    if settings.kv_cache_gib is not None:
        sim["kv_cache_gib"] = settings.kv_cache_gib
    if settings.cost_profile:
        sim["profile"] = settings.cost_profile
    args.plugin_config = {"sim": sim}
    return args.create_engine_config()


def make_real_args(settings: BenchSettings, scheduler: str, max_context: int) -> Any:
    """The ``EngineArgs`` of one real-engine run."""
    return _engine_args(settings, scheduler, max_context, model=settings.model)


def make_backend(
    settings: BenchSettings, scheduler: str, max_context: int, mode: str = "stateless"
) -> SimBackend | RealBackend | HttpBackend:
    """The backend of one replay: a fresh engine (sim, real) for ``scheduler`` replaying in ``mode``, or the server
    (``scheduler`` is then only a label: the server runs the scheduler it was started with)."""
    check_mode(mode, settings.engine)
    sessions = mode == "sessions"
    if settings.engine == "sim":
        config = make_sim_config(settings, scheduler, max_context)
        return SimSessionBackend(config) if sessions else SimBackend(config)
    if settings.engine == "real":
        args = make_real_args(settings, scheduler, max_context)
        return RealSessionBackend(args) if sessions else RealBackend(args)
    if not is_http_engine(settings.engine):
        raise ValueError(f"engine must be 'sim', 'real' or an http(s):// URL, got {settings.engine!r}.")
    backend = HttpBackend(
        settings.engine, model=settings.model, api_key=settings.api_key, vocab_size=settings.vocab_size
    )
    if backend.max_model_len is not None and max_context > backend.max_model_len:
        backend.shutdown()
        raise ValueError(
            f"The trace needs {max_context} tokens of context; the server's model takes {backend.max_model_len} "
            "(shrink it with --token-scale)."
        )
    return backend


def _fmt(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``n/a`` where the backend could not see it."""
    return "n/a" if value is None else format(value, spec)


def run_sweep(
    workloads: Mapping[str, Sequence[Job]],
    loads: Sequence[float],
    schedulers: Sequence[str],
    settings: BenchSettings,
    *,
    modes: Sequence[str] = ("stateless",),
    log: Callable[[str], None] = print,
) -> list[RunResult]:
    """Every (workload, load, scheduler, mode), with the same jobs and Poisson arrivals for every scheduler and mode.

    Against a server (``settings.engine`` a URL) give one scheduler: its name labels the rows.
    """
    from vllite.plugins.bench.traces import poisson_arrivals

    if is_http_engine(settings.engine) and len(schedulers) != 1:
        raise ValueError(
            "A server runs one scheduler: give one --schedulers label per replay (restart the server with another "
            "--scheduler-cls and replay again to compare)."
        )
    for mode in modes:
        check_mode(mode, settings.engine)
    results: list[RunResult] = []
    for workload, jobs in workloads.items():
        max_context = max(j.max_context for j in jobs)
        for jps in loads:
            drawn = poisson_arrivals(len(jobs), jps, seed=settings.seed)
            arrivals = [j.arrival_s if j.arrival_s is not None else t for j, t in zip(jobs, drawn)]
            for scheduler in schedulers:
                for mode in modes:
                    results.append(_run_mode(jobs, arrivals, settings, scheduler, mode, workload, jps, max_context))
                    log(_log_line(results[-1].summary()))
    return results


def _log_line(row: dict[str, Any]) -> str:
    """One replay's figures on one line."""
    return (
        f"{row['workload']:>6} jps={row['jps']:<7g} {mode_label(row['scheduler'], row['mode']):>10}: "
        f"avg JCT {row['avg_jct_s']:9.2f} s  p90 {row['p90_jct_s']:9.2f}  p95 {row['p95_jct_s']:9.2f}  "
        f"hit {_fmt(row['prefix_hit_rate'], '.3f')}  preempt {_fmt(row['preemptions'], '6d')}  "
        f"prompt computed {_fmt(row['prompt_tokens_computed'], 'd')}  "
        f"sched {_fmt(row['sched_ms_per_step'], '.3f')} ms/step "
        f"({_fmt(row['sched_cpu_ms_per_step'], '.3f')} CPU)  ({row['wall_s']:.1f} s wall)"
    )


def _run_mode(
    jobs: Sequence[Job],
    arrivals: Sequence[float],
    settings: BenchSettings,
    scheduler: str,
    mode: str,
    workload: str,
    jps: float,
    max_context: int,
) -> RunResult:
    """One replay of ``jobs`` on a fresh backend for (``scheduler``, ``mode``)."""
    backend = make_backend(settings, scheduler, max_context, mode)
    profile = getattr(backend, "profile", None)
    result = run_one(
        jobs,
        arrivals,
        backend,
        scheduler=scheduler,
        workload=workload,
        jobs_per_s=jps,
        tool_time_scale=settings.tool_time_scale,
        seed=settings.seed,
        mode=mode,
    )
    result.profile = list(profile or [])
    return result


# ---------------------------------------------------------------------------------------------- report
REPORT_FIELDS = (
    "workload", "scheduler", "mode", "jps", "jobs", "completed", "avg_jct_s", "p50_jct_s", "p90_jct_s", "p95_jct_s",
    "makespan_s", "throughput_jobs_per_s", "prefix_hit_rate", "preemptions", "steps", "sched_ms_per_step",
    "sched_cpu_ms_per_step", "num_gpu_blocks", "prompt_tokens_computed", "tokens_scheduled", "wall_s",
)  # fmt: skip


def _ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``; 0.0 for a zero base (as before), None when either is unknown."""
    if value is None or base is None:
        return None
    return value / base if base else 0.0


def _mode(row: dict[str, Any]) -> str:
    return str(row.get("mode") or "stateless")


def speedups(rows: Sequence[dict[str, Any]], baseline: str = "fcfs") -> list[dict[str, Any]]:
    """Per (workload, load, scheduler and mode other than the stateless baseline): baseline avg JCT / this avg JCT,
    sched-time ratio (``None`` where either run has no scheduler time, e.g. replays against a server) and prompt
    tokens computed as a fraction of the baseline's (``None`` where either is unknown)."""
    base = {(r["workload"], r["jps"]): r for r in rows if r["scheduler"] == baseline and _mode(r) == "stateless"}
    out = []
    for r in rows:
        b = base.get((r["workload"], r["jps"]))
        if r is b or b is None or not r["avg_jct_s"]:
            continue
        out.append({
            "workload": r["workload"], "jps": r["jps"], "scheduler": r["scheduler"], "mode": _mode(r),
            "jct_speedup": b["avg_jct_s"] / r["avg_jct_s"],
            "sched_time_ratio": _ratio(r["sched_ms_per_step"], b["sched_ms_per_step"]),
            "sched_cpu_ratio": _ratio(r["sched_cpu_ms_per_step"], b["sched_cpu_ms_per_step"]),
            "prompt_tokens_ratio": _fraction(r.get("prompt_tokens_computed"), b.get("prompt_tokens_computed")),
        })  # fmt: skip
    return out


def _fraction(value: float | None, base: float | None) -> float | None:
    """``value / base``; None when either is unknown or the base is zero."""
    return value / base if value is not None and base else None


def _settings_dict(settings: BenchSettings) -> dict[str, Any]:
    """The settings for the report, without the API key."""
    import dataclasses

    values = dataclasses.asdict(settings)
    values.pop("api_key", None)
    return values


def write_report(
    results: Sequence[RunResult], out_dir: str, *, settings: BenchSettings | None = None, plot: bool = True
) -> dict[str, str]:
    """Writes ``results.json`` (rows, speedups, settings), ``results.csv`` and, if ``plot``, ``jct_vs_load.png``.

    Returns the paths written. Without matplotlib the plot is skipped with a warning (install ``vllite[bench]``).
    """
    import csv
    import json
    from pathlib import Path

    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    rows = [r.summary() for r in results]
    paths: dict[str, str] = {}
    payload = {
        "rows": rows,
        "speedups": speedups(rows),
        "settings": _settings_dict(settings) if settings else None,
    }
    (directory / "results.json").write_text(json.dumps(payload, indent=2), encoding="utf-8")
    paths["json"] = str(directory / "results.json")
    with (directory / "results.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=REPORT_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    paths["csv"] = str(directory / "results.csv")
    profiles = [p for r in results for p in r.profile]
    if profiles:
        lines = "".join(json.dumps(p) + "\n" for p in profiles if p["num_tokens"] > 0)
        (directory / "step_profile.jsonl").write_text(lines, encoding="utf-8")
        paths["profile"] = str(directory / "step_profile.jsonl")
    if plot:
        png = plot_jct(rows, directory / "jct_vs_load.png")
        if png:
            paths["plot"] = png
    return paths


def plot_jct(rows: Sequence[dict[str, Any]], path: Any) -> str | None:
    """Average JCT against load, one line per scheduler (and mode), one panel per workload; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (pip install 'vllite[bench]' or matplotlib).")
        return None
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for label in sorted({mode_label(r["scheduler"], _mode(r)) for r in rows if r["workload"] == workload}):
            points = sorted(
                (r["jps"], r["avg_jct_s"])
                for r in rows
                if r["workload"] == workload and mode_label(r["scheduler"], _mode(r)) == label
            )
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_title(workload)
        ax.set_xlabel("load (jobs/s)")
        ax.set_ylabel("average job completion time (s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
