"""Agent-trace replay: jobs of multi-turn LLM calls separated by tool calls, against one scheduler at one load.

One event loop serves two backends:

- :class:`SimBackend` — ``EngineCore`` with the simulated executor (``vllite.schedulers.sim_executor``) on a
  :class:`SimClock` it shares with the scheduler. Discrete-event: each engine step advances virtual time by its
  modelled cost; job arrivals and tool completions are delivered when the clock reaches them; when the engine is
  idle the clock jumps to the next event. Paper-scale workloads replay in minutes of CPU time.
- :class:`RealBackend` — ``LLMEngine`` with a real (small) model, in wall time; tool calls are real delays.

Each turn's prompt is the job's history (earlier prompts and the outputs the engine actually produced) plus the
turn's new tokens, so prefix caching sees what it would see in an agent; output lengths are forced with
``max_tokens`` and ``ignore_eos``. Requests carry ``extra_args`` ``{job_id, is_last_step, this_func_call}``, what
the Continuum scheduler reads. :func:`run_sweep` runs every (workload, load, scheduler) on the same KV budget;
:func:`write_report` writes ``results.json``, ``results.csv`` and ``jct_vs_load.png``.
"""

from __future__ import annotations

import heapq
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllite.sampling_params import SamplingParams
from vllite.schedulers.traces import Job

logger = logging.getLogger(__name__)

#: (request id, new token ids, finished) for every request that progressed in a step.
StepEvents = list[tuple[str, list[int], bool]]


def new_prompt_tokens(job_id: str, turn_index: int, count: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The new prompt tokens of a turn: reproducible ids in ``[0, vocab_size)``."""
    rng = random.Random(f"{seed}:{job_id}:{turn_index}")
    return [rng.randrange(vocab_size) for _ in range(count)]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class SchedulerTimer:
    """Time spent in a scheduler's ``schedule()`` and ``update_from_output()``, per engine step.

    ``seconds`` is wall-clock time (``perf_counter``); ``cpu_seconds`` is this thread's CPU time
    (``thread_time``), which other processes on a shared machine disturb far less. Installed by wrapping the two
    bound methods on the instance; the scheduler's code is not changed.
    """

    def __init__(self, scheduler: Any) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def timed(method: Callable[..., Any], counts_step: bool) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                start, cpu = time.perf_counter(), time.thread_time()
                try:
                    return method(*args, **kwargs)
                finally:
                    self.cpu_seconds += time.thread_time() - cpu
                    self.seconds += time.perf_counter() - start
                    self.steps += counts_step

            return wrapper

        scheduler.schedule = timed(schedule, True)
        scheduler.update_from_output = timed(update, False)

    @property
    def ms_per_step(self) -> float:
        """Wall-clock milliseconds per step."""
        return 1000.0 * self.seconds / self.steps if self.steps else 0.0

    @property
    def cpu_ms_per_step(self) -> float:
        """CPU milliseconds per step."""
        return 1000.0 * self.cpu_seconds / self.steps if self.steps else 0.0


# ---------------------------------------------------------------------------------------------- backends
class SimBackend:
    """``EngineCore`` over the ``sim`` executor; time is the shared virtual clock."""

    virtual = True

    def __init__(self, config: Any) -> None:
        from vllite.engine.core import EngineCore
        from vllite.schedulers.sim_executor import SimClock, SimExecutor

        sim = config.plugin_config.setdefault("sim", {})
        self.clock: SimClock = sim.setdefault("clock", SimClock())
        self.core = EngineCore(config, executor_class=SimExecutor)
        self.scheduler = self.core.scheduler
        self.executor = self.core.model_executor
        self.vocab_size = self.executor.vocab_size
        self.num_gpu_blocks = int(config.cache_config.num_gpu_blocks or 0)
        self.hit_baseline = (0, 0)  # prefix-cache (queries, hits) before the replay
        self.timer = SchedulerTimer(self.scheduler)

    def now(self) -> float:
        return self.clock()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        from vllite.protocol import EngineCoreRequest

        self.core.add_request(EngineCoreRequest(request_id, prompt, params, None, self.clock()))

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    def step(self) -> tuple[StepEvents, bool]:
        outputs, executed = self.core.step()
        events: StepEvents = []
        for batch in outputs.values():
            events.extend((o.request_id, list(o.new_token_ids), o.finished) for o in batch.outputs)
        return events, executed

    def wait_until(self, when: float) -> None:
        self.clock.advance_to(when)

    def idle_tick(self) -> None:
        self.clock.advance(max(1e-3, self.executor.cost_model.fixed_s))

    def shutdown(self) -> None:
        self.core.shutdown()


class RealBackend:
    """``LLMEngine`` (in-process) with a real model; wall time; records a step-time profile for the cost model."""

    virtual = False

    def __init__(self, engine_args: Any) -> None:
        from vllite.engine.llm_engine import LLMEngine
        from vllite.schedulers.sim_executor import step_load

        self.engine = LLMEngine.from_engine_args(engine_args, multiprocess=False)
        core = self.engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.timer = SchedulerTimer(self.scheduler)
        hf = core.config.model_config.hf_text_config
        self.vocab_size = int(getattr(hf, "vocab_size", 0) or 1000)
        self.num_gpu_blocks = int(core.config.cache_config.num_gpu_blocks or 0)
        self.profile: list[dict[str, float]] = []
        execute = core.model_executor.execute_model

        def profiled(scheduler_output: Any) -> Any:
            start = time.perf_counter()
            result = execute(scheduler_output)
            num_tokens, num_context = step_load(scheduler_output)
            self.profile.append(
                {"num_tokens": num_tokens, "num_context_tokens": num_context, "seconds": time.perf_counter() - start}
            )
            return result

        core.model_executor.execute_model = profiled
        self._warm_up()
        self._t0 = time.monotonic()

    def _warm_up(self) -> None:
        """One short request before the clock starts, so first-step costs (lazy imports, allocation) are not
        charged to the first job; its steps are left out of the profile and the scheduler timing."""
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        self.engine.add_request("bench-warmup", list(range(1, 17)), params)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.profile.clear()
        stats = self.scheduler.kv_cache_manager.prefix_cache_stats
        self.hit_baseline = (stats.queries, stats.hits)
        self.timer.steps, self.timer.seconds, self.timer.cpu_seconds = 0, 0.0, 0.0

    def now(self) -> float:
        return time.monotonic() - self._t0

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt, params)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> tuple[StepEvents, bool]:
        events: StepEvents = []
        for out in self.engine.step():
            events.append((out.request_id, list(out.outputs[0].token_ids), out.finished))
        return events, True

    def wait_until(self, when: float) -> None:
        delay = when - self.now()
        if delay > 0:
            time.sleep(delay)

    def idle_tick(self) -> None:
        time.sleep(1e-3)

    def shutdown(self) -> None:
        self.engine.shutdown()


# ---------------------------------------------------------------------------------------------- replay
@dataclass
class RunResult:
    """One replay: per-job completion times and the engine's figures."""

    scheduler: str
    workload: str
    jobs_per_s: float
    jct_s: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    num_jobs: int = 0
    num_requests: int = 0
    prefix_hit_rate: float = 0.0
    preemptions: int = 0
    steps: int = 0
    sched_ms_per_step: float = 0.0
    sched_cpu_ms_per_step: float = 0.0
    wall_s: float = 0.0
    num_gpu_blocks: int = 0
    profile: list[dict[str, float]] = field(default_factory=list)  # real engine: measured step times

    def summary(self) -> dict[str, Any]:
        """The report row: average / P50 / P90 / P95 JCT, throughput, cache and scheduler figures."""
        jct = self.jct_s
        return {
            "workload": self.workload,
            "scheduler": self.scheduler,
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
            "wall_s": self.wall_s,
        }


@dataclass
class _JobState:
    job: Job
    arrival: float
    next_turn: int = 0
    history: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    finish: float | None = None


def turn_params(job: Job, index: int) -> SamplingParams:
    """Sampling parameters of a turn: forced output length and the Continuum ``extra_args``."""
    turn = job.turns[index]
    last = index == len(job.turns) - 1
    extra: dict[str, Any] = {"job_id": job.job_id, "is_last_step": last}
    if turn.tool is not None:
        extra["this_func_call"] = turn.tool
    return SamplingParams(temperature=0.0, max_tokens=turn.output_tokens, ignore_eos=True, extra_args=extra)


def replay(
    jobs: Sequence[Job],
    arrivals: Sequence[float],
    backend: SimBackend | RealBackend,
    *,
    tool_time_scale: float = 1.0,
    seed: int = 0,
    max_stall_s: float = 3600.0,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[float], float]:
    """Replays ``jobs`` (job ``i`` arrives at ``arrivals[i]``) on ``backend``; returns (JCTs, makespan).

    Raises ``RuntimeError`` if the engine makes no progress for ``max_stall_s`` with nothing else to wait for.
    """
    states = [_JobState(job, arrival) for job, arrival in zip(jobs, arrivals, strict=True)]
    events: list[tuple[float, int, int]] = [(s.arrival, i, i) for i, s in enumerate(states)]  # (time, seq, job)
    heapq.heapify(events)
    seq = len(events)
    by_request: dict[str, int] = {}
    done = 0
    stalled_since: float | None = None
    start = backend.now()

    def submit(index: int) -> None:
        state = states[index]
        turn = state.next_turn
        state.history += new_prompt_tokens(
            state.job.job_id, turn, state.job.turns[turn].new_prompt_tokens, backend.vocab_size, seed
        )
        request_id = f"{state.job.job_id}#{turn}"
        by_request[request_id] = index
        state.outputs = []
        backend.submit(request_id, list(state.history), turn_params(state.job, turn))

    while done < len(states):
        now = backend.now()
        while events and events[0][0] <= now:
            submit(heapq.heappop(events)[2])
        if not backend.has_work():
            if not events:
                raise RuntimeError(f"Replay lost track: {len(states) - done} jobs unfinished, nothing in flight.")
            backend.wait_until(events[0][0])
            continue
        step_events, executed = backend.step()
        now = backend.now()
        for request_id, tokens, finished in step_events:
            index = by_request.get(request_id)
            if index is None:
                continue
            state = states[index]
            state.outputs = tokens if not backend.virtual else state.outputs + tokens
            if not finished:
                continue
            del by_request[request_id]
            state.history += state.outputs
            turn = state.job.turns[state.next_turn]
            state.next_turn += 1
            if state.next_turn == len(state.job.turns):
                state.finish = now
                done += 1
                if progress is not None:
                    progress(done, len(states))
            else:
                heapq.heappush(events, (now + turn.tool_duration_s * tool_time_scale, seq, index))
                seq += 1
        if executed or step_events:
            stalled_since = None
        elif events and backend.virtual:
            backend.wait_until(events[0][0])
        else:
            stalled_since = now if stalled_since is None else stalled_since
            if now - stalled_since > max_stall_s:
                raise RuntimeError(f"The engine made no progress for {max_stall_s} s with requests in flight.")
            backend.idle_tick()
    jct = [s.finish - s.arrival for s in states if s.finish is not None]
    makespan = max(s.finish for s in states if s.finish is not None) - start - min(arrivals, default=0.0)
    return jct, makespan


def run_one(
    jobs: Sequence[Job],
    arrivals: Sequence[float],
    backend: SimBackend | RealBackend,
    *,
    scheduler: str,
    workload: str,
    jobs_per_s: float,
    tool_time_scale: float = 1.0,
    seed: int = 0,
) -> RunResult:
    """Replays and collects a :class:`RunResult`; shuts the backend down."""
    wall = time.perf_counter()
    try:
        jct, makespan = replay(jobs, arrivals, backend, tool_time_scale=tool_time_scale, seed=seed)
        sched = backend.scheduler
        stats = sched.kv_cache_manager.prefix_cache_stats
        queries, hits = stats.queries - backend.hit_baseline[0], stats.hits - backend.hit_baseline[1]
        return RunResult(
            scheduler=scheduler,
            workload=workload,
            jobs_per_s=jobs_per_s,
            jct_s=jct,
            makespan_s=makespan,
            num_jobs=len(jobs),
            num_requests=sum(len(j.turns) for j in jobs),
            prefix_hit_rate=hits / queries if queries else 0.0,
            preemptions=sched.num_preemptions_total,
            steps=backend.timer.steps,
            sched_ms_per_step=backend.timer.ms_per_step,
            sched_cpu_ms_per_step=backend.timer.cpu_ms_per_step,
            wall_s=time.perf_counter() - wall,
            num_gpu_blocks=backend.num_gpu_blocks,
        )
    finally:
        backend.shutdown()


# ---------------------------------------------------------------------------------------------- sweeps
@dataclass
class BenchSettings:
    """One benchmark: the engine shape and KV budget every scheduler gets, and how to replay."""

    engine: str = "sim"  # "sim" (virtual time) or "real" (a model, wall time)
    model: str | None = None  # real engine: model folder (default: the demo model)
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


def make_sim_config(settings: BenchSettings, scheduler: str, max_context: int) -> Any:
    """The ``EngineConfig`` of one simulated run (fresh virtual clock, same KV budget for every scheduler)."""
    from vllite.config import EngineArgs
    from vllite.schedulers.sim_executor import DEFAULT_MAX_MODEL_LEN

    args = EngineArgs(
        model="sim",
        skip_tokenizer_init=True,
        device="sim",
        executor="sim",
        block_size=settings.block_size,
        num_gpu_blocks_override=settings.num_gpu_blocks,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len or max(DEFAULT_MAX_MODEL_LEN, max_context),
        scheduler_cls=scheduler,
        prefix_caching_hash_algo="fast",
        seed=settings.seed,
    )
    if settings.tool_call_estimator:
        args.tool_call_estimator = settings.tool_call_estimator
    sim: dict[str, Any] = {"cost": dict(settings.cost), "seed": settings.seed}
    if settings.kv_cache_gib is not None:
        sim["kv_cache_gib"] = settings.kv_cache_gib
    if settings.cost_profile:
        sim["profile"] = settings.cost_profile
    args.plugin_config = {"sim": sim}
    return args.create_engine_config()


def make_real_args(settings: BenchSettings, scheduler: str, max_context: int) -> Any:
    """The ``EngineArgs`` of one real-engine run."""
    from vllite.config import EngineArgs

    args = EngineArgs(
        model=settings.model,
        block_size=settings.block_size,
        num_gpu_blocks_override=settings.num_gpu_blocks,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len or max_context,
        scheduler_cls=scheduler,
        seed=settings.seed,
    )
    if settings.tool_call_estimator:
        args.tool_call_estimator = settings.tool_call_estimator
    return args


def run_sweep(
    workloads: dict[str, Sequence[Job]],
    loads: Sequence[float],
    schedulers: Sequence[str],
    settings: BenchSettings,
    *,
    log: Callable[[str], None] = print,
) -> list[RunResult]:
    """Every (workload, load, scheduler), with the same jobs and Poisson arrivals for every scheduler."""
    from vllite.schedulers.traces import poisson_arrivals

    results: list[RunResult] = []
    for workload, jobs in workloads.items():
        max_context = max(j.max_context for j in jobs)
        for jps in loads:
            drawn = poisson_arrivals(len(jobs), jps, seed=settings.seed)
            arrivals = [j.arrival_s if j.arrival_s is not None else t for j, t in zip(jobs, drawn)]
            for scheduler in schedulers:
                if settings.engine == "sim":
                    backend: SimBackend | RealBackend = SimBackend(make_sim_config(settings, scheduler, max_context))
                elif settings.engine == "real":
                    backend = RealBackend(make_real_args(settings, scheduler, max_context))
                else:
                    raise ValueError(f"engine must be 'sim' or 'real', got {settings.engine!r}.")
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
                )
                result.profile = list(profile or [])
                results.append(result)
                row = result.summary()
                log(
                    f"{workload:>6} jps={jps:<7g} {scheduler:>10}: avg JCT {row['avg_jct_s']:9.2f} s  "
                    f"p90 {row['p90_jct_s']:9.2f}  p95 {row['p95_jct_s']:9.2f}  hit {row['prefix_hit_rate']:.3f}  "
                    f"preempt {row['preemptions']:6d}  sched {row['sched_ms_per_step']:.3f} ms/step "
                    f"({row['sched_cpu_ms_per_step']:.3f} CPU)  "
                    f"({row['wall_s']:.1f} s wall)"
                )
    return results


# ---------------------------------------------------------------------------------------------- report
REPORT_FIELDS = (
    "workload", "scheduler", "jps", "jobs", "completed", "avg_jct_s", "p50_jct_s", "p90_jct_s", "p95_jct_s",
    "makespan_s", "throughput_jobs_per_s", "prefix_hit_rate", "preemptions", "steps", "sched_ms_per_step",
    "sched_cpu_ms_per_step", "num_gpu_blocks", "wall_s",
)  # fmt: skip


def speedups(rows: Sequence[dict[str, Any]], baseline: str = "fcfs") -> list[dict[str, Any]]:
    """Per (workload, load, scheduler != baseline): baseline avg JCT / scheduler avg JCT, and sched-time ratio."""
    base = {(r["workload"], r["jps"]): r for r in rows if r["scheduler"] == baseline}
    out = []
    for r in rows:
        b = base.get((r["workload"], r["jps"]))
        if r["scheduler"] == baseline or b is None or not r["avg_jct_s"]:
            continue
        out.append({
            "workload": r["workload"], "jps": r["jps"], "scheduler": r["scheduler"],
            "jct_speedup": b["avg_jct_s"] / r["avg_jct_s"],
            "sched_time_ratio": r["sched_ms_per_step"] / b["sched_ms_per_step"] if b["sched_ms_per_step"] else 0.0,
            "sched_cpu_ratio": (
                r["sched_cpu_ms_per_step"] / b["sched_cpu_ms_per_step"] if b["sched_cpu_ms_per_step"] else 0.0
            ),
        })  # fmt: skip
    return out


def write_report(
    results: Sequence[RunResult], out_dir: str, *, settings: BenchSettings | None = None, plot: bool = True
) -> dict[str, str]:
    """Writes ``results.json`` (rows, speedups, settings), ``results.csv`` and, if ``plot``, ``jct_vs_load.png``.

    Returns the paths written. Without matplotlib the plot is skipped with a warning (install ``vllite[bench]``).
    """
    import csv
    import dataclasses
    import json
    from pathlib import Path

    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    rows = [r.summary() for r in results]
    paths: dict[str, str] = {}
    payload = {
        "rows": rows,
        "speedups": speedups(rows),
        "settings": dataclasses.asdict(settings) if settings else None,
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
    """Average JCT against load, one line per scheduler, one panel per workload; None without matplotlib."""
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
        for scheduler in sorted({r["scheduler"] for r in rows if r["workload"] == workload}):
            points = sorted(
                (r["jps"], r["avg_jct_s"]) for r in rows if (r["workload"], r["scheduler"]) == (workload, scheduler)
            )
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=scheduler)
        ax.set_title(workload)
        ax.set_xlabel("load (jobs/s)")
        ax.set_ylabel("average job completion time (s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
