"""Agent-trace replay: jobs of multi-turn LLM calls separated by tool calls, against one scheduler at one load.

One event loop serves three backends:

- :class:`SimBackend` — ``EngineCore`` with the simulated executor (``vllite.plugins.bench.sim_executor``) on a
  :class:`SimClock` it shares with the scheduler. Discrete-event: each engine step advances virtual time by its
  modelled cost; job arrivals and tool completions are delivered when the clock reaches them; when the engine is
  idle the clock jumps to the next event. Paper-scale workloads replay in minutes of CPU time.
- :class:`RealBackend` — ``LLMEngine`` with a real (small) model, in wall time; tool calls are real delays.
- :class:`~vllite.plugins.bench.agent_http.HttpBackend` — a live OpenAI-compatible server (``vllite serve``, vLLM)
  over HTTP, in wall time; the scheduler is whatever the server runs.

Each turn's prompt is the job's history (earlier prompts and the outputs the engine actually produced) plus the
turn's new tokens, so prefix caching sees what it would see in an agent; output lengths are forced with
``max_tokens`` and ``ignore_eos``. Requests carry ``extra_args`` ``{job_id, is_last_step, this_func_call}``, what
the Continuum scheduler reads. Sweeps, results and the report (``run_sweep``, ``RunResult``, ``write_report``,
...) live in :mod:`vllite.plugins.bench.agent_report`; read from this module they still work one release, with a
``DeprecationWarning``.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from vllite import deprecated_aliases
from vllite.plugins.bench.errors import BenchReplayError
from vllite.plugins.bench.traces import Job
from vllite.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllite.sched import Scheduler

#: (request id, new token ids, finished) for every request that progressed in a step.
StepEvents = list[tuple[str, list[int], bool]]


def new_prompt_tokens(job_id: str, turn_index: int, count: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The new prompt tokens of a turn: reproducible ids in ``[0, vocab_size)``."""
    rng = random.Random(f"{seed}:{job_id}:{turn_index}")
    return [rng.randrange(vocab_size) for _ in range(count)]


class SchedulerTimer:
    """Time spent in a scheduler's ``schedule()`` and ``update_from_output()``, per engine step.

    ``seconds`` is wall-clock time (``perf_counter``); ``cpu_seconds`` is this thread's CPU time
    (``thread_time``), which other processes on a shared machine disturb far less. ``tokens`` counts the tokens the
    steps scheduled (prefill, recomputation after preemptions or releases, and decode): what the model computed.
    Installed by wrapping the two bound methods on the instance; the scheduler's code is not changed.
    """

    def __init__(self, scheduler: Any) -> None:
        self.reset()
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def timed(method: Callable[..., Any], counts_step: bool) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                start, cpu = time.perf_counter(), time.thread_time()
                try:
                    result = method(*args, **kwargs)
                    if counts_step:
                        self.tokens += int(getattr(result, "total_num_scheduled_tokens", 0) or 0)
                    return result
                finally:
                    self.cpu_seconds += time.thread_time() - cpu
                    self.seconds += time.perf_counter() - start
                    self.steps += counts_step

            return wrapper

        scheduler.schedule = timed(schedule, True)
        scheduler.update_from_output = timed(update, False)

    def reset(self) -> None:
        """Forgets the steps, tokens and time measured so far."""
        self.steps, self.seconds, self.cpu_seconds = 0, 0.0, 0.0
        self.tokens = 0

    @property
    def ms_per_step(self) -> float:
        """Wall-clock milliseconds per step."""
        return 1000.0 * self.seconds / self.steps if self.steps else 0.0

    @property
    def cpu_ms_per_step(self) -> float:
        """CPU milliseconds per step."""
        return 1000.0 * self.cpu_seconds / self.steps if self.steps else 0.0


# ---------------------------------------------------------------------------------------------- backends
class ReplayBackend(Protocol):
    """What :func:`replay` drives: :class:`SimBackend`, :class:`RealBackend`, or
    :class:`~vllite.plugins.bench.agent_http.HttpBackend` (a live server).

    ``virtual`` backends report new tokens per step and have a clock that :meth:`wait_until` jumps; wall-time
    backends report each request's cumulative tokens.
    """

    virtual: bool
    vocab_size: int

    def now(self) -> float: ...
    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> tuple[StepEvents, bool]: ...
    def wait_until(self, when: float) -> None: ...
    def idle_tick(self) -> None: ...
    def shutdown(self) -> None: ...


class SimBackend:
    """``EngineCore`` over the ``sim`` executor; time is the shared virtual clock."""

    virtual = True

    def __init__(self, config: Any) -> None:
        from vllite.engine.core import EngineCore
        from vllite.plugins.bench.sim_executor import SimClock, SimExecutor

        sim = config.plugin_config.setdefault("sim", {})
        self.clock: SimClock = sim.setdefault("clock", SimClock())
        self.core = EngineCore(config, executor_class=SimExecutor)
        # The benchmark compares policies, all subclasses of vllite.sched.Scheduler (the report reads its
        # kv_cache_manager and num_preemptions_total); the engine core only knows its SchedulerInterface.
        self.scheduler = cast("Scheduler", self.core.scheduler)
        self.executor = self.core.model_executor
        self.vocab_size = self.executor.vocab_size
        self.num_gpu_blocks = self.core.info.num_gpu_blocks
        self.hit_baseline = (0, 0)  # prefix-cache (queries, hits) before the replay
        self.timer = SchedulerTimer(self.scheduler)
        # Prompt tokens computed: per finished request, prompt length - the tokens its first schedule found cached.
        self.prompt_tokens_computed = 0
        self._prompt_lens: dict[str, int] = {}

    def now(self) -> float:
        """The virtual time, in seconds."""
        return self.clock()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Adds a request to the engine core, stamped with the virtual arrival time."""
        from vllite.protocol import EngineCoreRequest

        self._prompt_lens[request_id] = len(prompt)
        self.core.add_request(EngineCoreRequest(request_id, prompt, params, None, self.clock()))

    def has_work(self) -> bool:
        """Whether the scheduler holds any request (waiting or running)."""
        return self.scheduler.has_requests()

    def step(self) -> tuple[StepEvents, bool]:
        """One engine step: the request events and whether a batch was executed."""
        outputs, executed = self.core.step()
        events: StepEvents = []
        for batch in outputs.values():
            for o in batch.outputs:
                if o.finished and o.request_id in self._prompt_lens:
                    self.prompt_tokens_computed += self._prompt_lens.pop(o.request_id) - o.num_cached_tokens
                events.append((o.request_id, list(o.new_token_ids), o.finished))
        return events, executed

    def wait_until(self, when: float) -> None:
        """Jumps the virtual clock to ``when`` (the next arrival or tool completion)."""
        self.clock.advance_to(when)

    def idle_tick(self) -> None:
        """Advances the clock by one fixed step cost (at least 1 ms) when the engine did nothing."""
        self.clock.advance(max(1e-3, self.executor.cost_model.fixed_s))

    def shutdown(self) -> None:
        """Shuts the engine core down."""
        self.core.shutdown()


class RealBackend:
    """``LLMEngine`` (in-process) with a real model; wall time; records a step-time profile for the cost model."""

    virtual = False

    def __init__(self, engine_args: Any) -> None:
        from vllite.engine.llm_engine import LLMEngine
        from vllite.plugins.bench.sim_executor import step_load
        from vllite.plugins.inprocess_client.client import InprocClient

        self.engine = LLMEngine.from_engine_args(engine_args, multiprocess=False)
        client = self.engine.engine_core
        assert isinstance(client, InprocClient)  # multiprocess=False
        core = client.engine_core
        self.scheduler = cast("Scheduler", core.scheduler)  # a policy: see SimBackend
        self.timer = SchedulerTimer(self.scheduler)
        self.vocab_size = core.info.vocab_size
        self.num_gpu_blocks = core.info.num_gpu_blocks
        self.profile: list[dict[str, float]] = []
        self.prompt_tokens_computed = 0  # per finished request: prompt length - its cached tokens
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
        self.timer.reset()
        self.prompt_tokens_computed = 0

    def now(self) -> float:
        """Wall time since the backend was ready, in seconds."""
        return time.monotonic() - self._t0

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Adds a request to the engine."""
        self.engine.add_request(request_id, prompt, params)

    def has_work(self) -> bool:
        """Whether the engine has unfinished requests."""
        return self.engine.has_unfinished_requests()

    def step(self) -> tuple[StepEvents, bool]:
        """One engine step: the request events (cumulative token ids) and ``True``."""
        events: StepEvents = []
        for out in self.engine.step():
            if out.finished:
                self.prompt_tokens_computed += len(out.prompt_token_ids or ()) - (out.num_cached_tokens or 0)
            events.append((out.request_id, list(out.outputs[0].token_ids), out.finished))
        return events, True

    def wait_until(self, when: float) -> None:
        """Sleeps until ``when`` (wall time since the start)."""
        delay = when - self.now()
        if delay > 0:
            time.sleep(delay)

    def idle_tick(self) -> None:
        """Sleeps 1 ms when the engine did nothing."""
        time.sleep(1e-3)

    def shutdown(self) -> None:
        """Shuts the engine down."""
        self.engine.shutdown()


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


class _Replay:
    """One replay's bookkeeping: each job's state, the time-ordered queue of turns to submit (job arrivals and
    tool completions) and the requests in flight. :func:`replay` drives the backend; this class only records."""

    def __init__(
        self,
        jobs: Sequence[Job],
        arrivals: Sequence[float],
        backend: ReplayBackend,
        *,
        tool_time_scale: float,
        seed: int,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.backend = backend
        self.tool_time_scale = tool_time_scale
        self.seed = seed
        self.progress = progress
        self.states = [_JobState(job, arrival) for job, arrival in zip(jobs, arrivals, strict=True)]
        self.events: list[tuple[float, int, int]] = [(s.arrival, i, i) for i, s in enumerate(self.states)]
        heapq.heapify(self.events)  # (time, seq, job index); seq keeps equal times in submission order
        self._seq = len(self.events)
        self._by_request: dict[str, int] = {}  # request id -> job index, for the turns in flight
        self._done = 0

    @property
    def unfinished(self) -> int:
        """The number of jobs with turns still to run."""
        return len(self.states) - self._done

    def submit_due(self, now: float) -> None:
        """Submits the next turn of every job whose arrival or tool call has ended by ``now``."""
        while self.events and self.events[0][0] <= now:
            self._submit(heapq.heappop(self.events)[2])

    def _submit(self, index: int) -> None:
        state = self.states[index]
        turn = state.next_turn
        state.history += new_prompt_tokens(
            state.job.job_id, turn, state.job.turns[turn].new_prompt_tokens, self.backend.vocab_size, self.seed
        )
        request_id = f"{state.job.job_id}#{turn}"
        self._by_request[request_id] = index
        state.outputs = []
        self.backend.submit(request_id, list(state.history), turn_params(state.job, turn))

    def record(self, step_events: StepEvents, now: float) -> None:
        """Takes one step's request events at time ``now``: the turns' outputs so far, and the turns that ended."""
        for request_id, tokens, finished in step_events:
            index = self._by_request.get(request_id)
            if index is None:
                continue
            state = self.states[index]
            state.outputs = tokens if not self.backend.virtual else state.outputs + tokens
            if finished:
                del self._by_request[request_id]
                self._end_turn(index, now)

    def _end_turn(self, index: int, now: float) -> None:
        """Adds a finished turn's output to its job's history; the job's next turn is due when the turn's tool call
        ends, or the job is done."""
        state = self.states[index]
        state.history += state.outputs
        turn = state.job.turns[state.next_turn]
        state.next_turn += 1
        if state.next_turn == len(state.job.turns):
            state.finish = now
            self._done += 1
            if self.progress is not None:
                self.progress(self._done, len(self.states))
        else:
            heapq.heappush(self.events, (now + turn.tool_duration_s * self.tool_time_scale, self._seq, index))
            self._seq += 1

    def results(self, start: float) -> tuple[list[float], float]:
        """(JCTs of the finished jobs, makespan), for a replay whose clock read ``start`` when it began."""
        jct = [s.finish - s.arrival for s in self.states if s.finish is not None]
        first_arrival = min((s.arrival for s in self.states), default=0.0)
        makespan = max(s.finish for s in self.states if s.finish is not None) - start - first_arrival
        return jct, makespan


def replay(
    jobs: Sequence[Job],
    arrivals: Sequence[float],
    backend: ReplayBackend,
    *,
    tool_time_scale: float = 1.0,
    seed: int = 0,
    max_stall_s: float = 3600.0,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[float], float]:
    """Replays ``jobs`` (job ``i`` arrives at ``arrivals[i]``) on ``backend``; returns (JCTs, makespan).

    Raises ``BenchReplayError`` if the engine makes no progress for ``max_stall_s`` with nothing else to wait for.
    """
    run = _Replay(jobs, arrivals, backend, tool_time_scale=tool_time_scale, seed=seed, progress=progress)
    stalled_since: float | None = None
    start = backend.now()
    while run.unfinished:
        now = backend.now()
        run.submit_due(now)
        if not backend.has_work():
            if not run.events:
                raise BenchReplayError(f"Replay lost track: {run.unfinished} jobs unfinished, nothing in flight.")
            backend.wait_until(run.events[0][0])
            continue
        step_events, executed = backend.step()
        now = backend.now()
        run.record(step_events, now)
        if executed or step_events:
            stalled_since = None
        elif run.events and backend.virtual:
            backend.wait_until(run.events[0][0])
        else:
            stalled_since = now if stalled_since is None else stalled_since
            if now - stalled_since > max_stall_s:
                raise BenchReplayError(f"The engine made no progress for {max_stall_s} s with requests in flight.")
            backend.idle_tick()
    return run.results(start)


_REPORT_NAMES: tuple[str, ...] = (
    "percentile",
    "RunResult",
    "run_one",
    "BenchSettings",
    "make_sim_config",
    "make_real_args",
)
_REPORT_NAMES += ("run_sweep", "REPORT_FIELDS", "speedups", "write_report", "plot_jct")


def __getattr__(name: str) -> Any:
    # The sweep and report names moved to agent_report (which imports this module): they keep working one release.
    return deprecated_aliases.moved_attribute(
        __name__, name, dict.fromkeys(_REPORT_NAMES, "vllite.plugins.bench.agent_report")
    )
