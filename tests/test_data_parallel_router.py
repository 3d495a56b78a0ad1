"""The data-parallel router with synthetic engine stats (no engine, no model): least-loaded balance, a named rank,
prefix and job affinity, ownership of requests in flight, dead engines; and how a DP client combines the engines'
answers to a utility call and splits the CPUs among its engines."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from vllite.exceptions import CpuThreadsConfigError, EngineDeadError
from vllite.plugins.engine_proc.dp_client import combine_results
from vllite.plugins.engine_proc.dp_engines import engine_cpu_overrides
from vllite.plugins.engine_proc.dp_router import DPRouter
from vllite.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, SchedulerStats
from vllite.sampling_params import SamplingParams


def make_request(request_id: str, prompt: list[int] | None = None, **extra_args) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=8, extra_args=extra_args or None)
    return EngineCoreRequest(request_id, prompt or [1, 2, 3, 4], params, None, time.time())


class SimulatedEngines:
    """Engines that admit up to ``max_running`` requests, finish a random running one per tick and publish their
    counts with their outputs, as DPEngineCoreProc does."""

    def __init__(self, router: DPRouter, num_engines: int, max_running: int = 8, seed: int = 0) -> None:
        self.router = router
        self.queues: list[list[str]] = [[] for _ in range(num_engines)]
        self.max_running = max_running
        self.rng = random.Random(seed)

    def submit(self, request: EngineCoreRequest) -> int:
        engine = self.router.route(request)
        self.queues[engine].append(request.request_id)
        return engine

    def tick(self, engine: int) -> None:
        queue = self.queues[engine]
        outputs = []
        if queue:
            running = min(len(queue), self.max_running)
            done = queue.pop(self.rng.randrange(running))
            outputs.append(EngineCoreOutput(done, [7], finish_reason=FinishReason.LENGTH))
        running = min(len(queue), self.max_running)
        stats = SchedulerStats(num_running_reqs=running, num_waiting_reqs=len(queue) - running)
        self.router.on_outputs(engine, EngineCoreOutputs(engine_index=engine, outputs=outputs, scheduler_stats=stats))


@pytest.mark.parametrize("num_engines", [2, 3])
def test_least_loaded_balances_1000_equal_requests_within_10_percent(num_engines):
    router = DPRouter(num_engines)
    engines = SimulatedEngines(router, num_engines)
    counts: Counter[int] = Counter()
    rng = random.Random(1)
    for i in range(1000):
        counts[engines.submit(make_request(f"r{i}"))] += 1
        # Engines publish at their own pace: some ticks are skipped, so stats lag the client's sends.
        for engine in range(num_engines):
            if rng.random() < 0.4:
                engines.tick(engine)
    share = 1000 / num_engines
    assert all(abs(counts[e] - share) <= 0.1 * share for e in range(num_engines)), counts


@pytest.mark.parametrize("step_rates", [(0.5, 0.1), (0.9, 0.05), (0.02, 0.02)])
def test_a_burst_is_split_evenly_while_stats_lag_the_sends(step_rates):
    """``LLM.generate`` submits its whole batch at once while the engines step: the stats an engine publishes after
    a step count only what it had taken in when the step began, so the requests sent during the step must still
    count after those stats arrive (they were dropped, and a 256-request burst split 157/99)."""
    router = DPRouter(2)
    taken_in: list[list[str]] = [[], []]
    in_pipe: list[list[str]] = [[], []]  # sent to the engine during its current step
    counts: Counter[int] = Counter()
    rng = random.Random(3)
    for i in range(256):
        engine = router.route(make_request(f"r{i}"))
        counts[engine] += 1
        in_pipe[engine].append(f"r{i}")
        for e, rate in enumerate(step_rates):  # the chance that the engine's current step ends now
            if rng.random() < rate:
                running = min(len(taken_in[e]), 8)
                stats = SchedulerStats(num_running_reqs=running, num_waiting_reqs=len(taken_in[e]) - running)
                router.on_outputs(e, EngineCoreOutputs(engine_index=e, scheduler_stats=stats))
                taken_in[e] += in_pipe[e]
                in_pipe[e] = []
    assert abs(counts[0] - counts[1]) <= 0.1 * 256, counts


def test_least_loaded_prefers_the_engine_with_fewer_waiting():
    router = DPRouter(2)
    # Engine 0: 3 running; engine 1: 1 waiting (weighs 4): engine 0 scores 3, engine 1 scores 4.
    router.on_outputs(0, EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=3)))
    router.on_outputs(1, EngineCoreOutputs(scheduler_stats=SchedulerStats(num_waiting_reqs=1)))
    assert router.route(make_request("a")) == 0
    # Engine 0 now has one sent since its stats (3 + 4 = 7 > 4): the next goes to engine 1.
    assert router.route(make_request("b")) == 1


def test_data_parallel_rank_is_honoured():
    router = DPRouter(3)
    for i in range(30):
        request = make_request(f"r{i}")
        request.data_parallel_rank = 2
        assert router.route(request) == 2
    assert {router.route(make_request(f"x{i}", data_parallel_rank=1)) for i in range(30)} == {1}
    with pytest.raises(ValueError, match=r"data_parallel_rank must be in \[0, 3\), got 5"):
        router.route(make_request("bad", data_parallel_rank=5))
    router.mark_dead(1)
    with pytest.raises(EngineDeadError, match="engine 1"):
        router.route(make_request("dead", data_parallel_rank=1))


def test_job_id_sends_every_turn_to_one_engine():
    router = DPRouter(4)
    rng = random.Random(0)
    jobs = [f"job-{j}" for j in range(20)]
    seen: dict[str, set[int]] = {job: set() for job in jobs}
    for turn in range(400):
        job = rng.choice(jobs)
        prompt = [rng.randrange(100) for _ in range(rng.randint(1, 40))]
        seen[job].add(router.route(make_request(f"t{turn}", prompt, job_id=job)))
        router.route(make_request(f"filler{turn}"))  # other load moves the least-loaded choice around
    assert all(len(engines) == 1 for engines in seen.values()), seen
    assert len({next(iter(e)) for e in seen.values()}) > 1  # jobs are spread over engines


def test_prefix_routing_sends_a_shared_first_block_to_one_engine():
    router = DPRouter(3, routing="prefix", block_size=4)
    rng = random.Random(0)
    prefixes = [[rng.randrange(100) for _ in range(4)] for _ in range(6)]
    seen: dict[int, set[int]] = {p: set() for p in range(6)}
    for i in range(300):
        p = rng.randrange(6)
        prompt = prefixes[p] + [rng.randrange(100) for _ in range(rng.randint(0, 20))]
        seen[p].add(router.route(make_request(f"r{i}", prompt)))
    assert all(len(engines) == 1 for engines in seen.values()), seen
    # Without prefix routing the same prompts spread.
    load = DPRouter(3, block_size=4)
    assert len({load.route(make_request(f"l{i}", prefixes[0] + [i])) for i in range(9)}) == 3


def test_an_affinity_whose_engine_died_moves_to_a_live_one():
    router = DPRouter(2)
    first = router.route(make_request("a", job_id="j"))
    router.mark_dead(first)
    moved = router.route(make_request("b", job_id="j"))
    assert moved != first
    assert router.route(make_request("c", job_id="j")) == moved


def test_ownership_finish_and_death():
    router = DPRouter(2)
    owners = {f"r{i}": router.route(make_request(f"r{i}")) for i in range(6)}
    assert router.group_by_owner(["r0", "r1", "unknown"]) == {owners["r0"]: ["r0"], owners["r1"]: ["r1"]}
    engine = owners["r0"]
    router.on_outputs(engine, EngineCoreOutputs(outputs=[EngineCoreOutput("r0", [1], finish_reason=FinishReason.STOP)]))
    assert router.owner("r0") is None
    failed = router.mark_dead(engine)
    assert failed == sorted(r for r, e in owners.items() if e == engine and r != "r0")
    assert router.live_engines() == [1 - engine]
    assert all(router.route(make_request(f"n{i}")) == 1 - engine for i in range(5))
    router.mark_dead(1 - engine)
    with pytest.raises(EngineDeadError, match="Every data-parallel engine core is dead"):
        router.route(make_request("none"))


def test_forget_undoes_a_route_that_was_never_sent():
    router = DPRouter(2)
    engine = router.route(make_request("a"))
    router.forget("a")
    assert router.owner("a") is None and router.engines[engine].sent == 0


def test_utility_answers_are_combined():
    assert combine_results("reset_prefix_cache", [True, False]) is False
    assert combine_results("is_sleeping", [True, True]) is True
    assert combine_results("get_request_counts", [[1, 2], [3, 4]]) == [4, 6]
    assert combine_results("get_num_unfinished_requests", [2, 5]) == 7
    assert combine_results("get_kv_cache_usage", [0.25, 0.75]) == 0.5
    assert combine_results("pause_scheduler", [None, None]) is None


def test_each_engine_gets_its_own_cpus():
    env = {"VLLITE_CPU_OMP_THREADS_BIND": "auto"}
    assert engine_cpu_overrides(2, env)[0] != engine_cpu_overrides(2, env)[1] or len(set(_mask())) == 1
    assert engine_cpu_overrides(2, {"VLLITE_CPU_OMP_THREADS_BIND": "0|0"}) == [
        {"VLLITE_CPU_OMP_THREADS_BIND": "0"},
        {"VLLITE_CPU_OMP_THREADS_BIND": "0"},
    ]
    assert engine_cpu_overrides(2, {"VLLITE_CPU_OMP_THREADS_BIND": "nobind"}) == [{}, {}]
    with pytest.raises(CpuThreadsConfigError, match="gives 3 CPU lists for data_parallel_size=2"):
        engine_cpu_overrides(2, {"VLLITE_CPU_OMP_THREADS_BIND": "0|0|0"})


def test_auto_splits_the_mask_into_contiguous_groups(monkeypatch):
    import vllite.plugins.engine_proc.dp_engines as dp_engines
    from vllite.platform import cpu_threads

    monkeypatch.setattr(dp_engines, "resolve_plan", lambda env: cpu_threads.resolve_plan(env, allowed=range(8)))
    monkeypatch.setattr(cpu_threads, "physical_core_cpus", lambda cpus: sorted(cpus))
    overrides = engine_cpu_overrides(2, {"VLLITE_CPU_NUM_OF_RESERVED_CPU": "0"})
    assert overrides == [{"VLLITE_CPU_OMP_THREADS_BIND": "0,1,2,3"}, {"VLLITE_CPU_OMP_THREADS_BIND": "4,5,6,7"}]
    # One thread per engine (the benchmark's setting) still gives each engine its own CPU.
    overrides = engine_cpu_overrides(3, {"VLLITE_CPU_NUM_THREADS": "1", "VLLITE_CPU_NUM_OF_RESERVED_CPU": "0"})
    assert overrides == [{"VLLITE_CPU_OMP_THREADS_BIND": c} for c in ("0,1,2", "3,4,5", "6,7")]


def _mask() -> set[int]:
    import os

    return os.sched_getaffinity(0)


def test_wave_coordinator_orders_wave_notices():
    from vllite.plugins.engine_proc.dp_waves import WaveCoordinator

    waves = WaveCoordinator()
    assert waves.stamp(make_request("a")) is True  # idle: this request starts wave 0
    assert waves.stamp(make_request("b")) is False
    assert waves.on_outputs(EngineCoreOutputs(wave_complete=0)) is None
    assert (waves.wave, waves.engines_running) == (1, False)
    # An engine starts wave 1 (a request crossed wave 0's end): the client must wake the others.
    assert waves.on_outputs(EngineCoreOutputs(start_wave=1)) == 1
    assert waves.engines_running
    # Wave 1 ends; a second engine's start_wave(1), overtaken on its socket, is stale and ignored.
    waves.on_outputs(EngineCoreOutputs(wave_complete=1))
    assert waves.on_outputs(EngineCoreOutputs(start_wave=1)) is None
    assert (waves.wave, waves.engines_running) == (2, False)
    # A wave_complete older than the current wave changes nothing.
    waves.on_outputs(EngineCoreOutputs(start_wave=2))
    waves.on_outputs(EngineCoreOutputs(wave_complete=1))
    assert (waves.wave, waves.engines_running) == (2, True)
    request = make_request("c")
    waves.stamp(request)
    assert request.current_wave == 2


def test_an_unavailable_backend_or_no_multiprocessing_is_a_clear_error():
    from vllite.engine.core_client import make_client
    from vllite.engine_args import EngineArgs

    config = EngineArgs(data_parallel_size=2, data_parallel_backend="nope").create_engine_config()
    with pytest.raises(ValueError, match=r"data_parallel_backend 'nope' is not available \(registered: mp"):
        make_client(config, multiprocess=True)
    with pytest.raises(ValueError, match="data_parallel_size > 1 needs the multiprocess engine"):
        make_client(config, multiprocess=False)


def test_a_sessions_chunks_follow_it_to_its_engine_until_it_ends():
    """A session's later chunks go to the engine holding its KV; a turn end (``session_open``)
    does not end the ownership, the session's finish does."""
    import msgspec

    router = DPRouter(2)
    first = msgspec.structs.replace(make_request("s"), resumable=True)
    owner = router.route(first)
    turn_end = EngineCoreOutput("s", [7], finish_reason=FinishReason.LENGTH, session_open=True)
    router.on_outputs(owner, EngineCoreOutputs(outputs=[turn_end]))
    chunk = msgspec.structs.replace(make_request("s", [5]), resumable=True, continuation=True)
    engines = set()
    for i in range(5):  # the chunks load the owner, so new requests go to the other engine: chunks do not follow load
        engines.add(router.route(make_request(f"r{i}")))
        assert router.route(chunk) == owner
    assert engines == {1 - owner}
    router.on_outputs(owner, EngineCoreOutputs(outputs=[EngineCoreOutput("s", [], finish_reason=FinishReason.STOP)]))
    assert router.owner("s") is None
