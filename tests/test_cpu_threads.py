"""CPU threads (issue 17 item 2): the bind-string parser, plan resolution, pinning, the adaptive governor's
decisions, and the engine-core process ending up with the configured threads."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from vllite.exceptions import CpuThreadsConfigError, VlliteError
from vllite.platform.cpu_threads import (
    ADAPTIVE_ENV,
    BIND_ENV,
    NUM_THREADS_ENV,
    RESERVED_ENV,
    CpuThreadPlan,
    parse_cpu_list,
    physical_core_cpus,
    place_other_threads,
    resolve_plan,
)
from vllite.plugins.transformers_executor import cpu_governor
from vllite.plugins.transformers_executor.cpu_governor import CpuThreadGovernor, OmpThreadPinner

TWO_CPUS = len(os.sched_getaffinity(0)) >= 2


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3", [0, 1, 2, 3]), ("0,2", [0, 2]), ("5,0-1", [5, 0, 1]), (" 3 , 4-5 ", [3, 4, 5]), ("7", [7])],
)
def test_parse_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "1,1", "0-2,2", "-1", "0--2", "", "0,,1", "1-2-3", "0.5"])
def test_parse_cpu_list_rejects_with_the_variable_name(text):
    with pytest.raises(CpuThreadsConfigError, match=BIND_ENV) as info:
        parse_cpu_list(text)
    assert isinstance(info.value, ValueError) and isinstance(info.value, VlliteError)


def test_physical_core_cpus_keeps_one_cpu_per_core(tmp_path: Path):
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):  # 2 cores x 2 hyperthreads, Linux numbering
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert physical_core_cpus([0, 1, 2, 3], sysfs=str(tmp_path)) == [0, 1]
    assert physical_core_cpus([2, 3, 9], sysfs=str(tmp_path)) == [2, 3, 9]  # cpu9: no topology, its own core


# ------------------------------------------------------------------ resolution
def test_auto_on_two_cores_uses_both_and_reserves_none():
    plan = resolve_plan({}, allowed=[0, 1])
    assert plan == CpuThreadPlan("auto", (0, 1), (), 2, True)
    assert plan.spawn_env() == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


def test_auto_reserves_the_last_core_when_there_is_room():
    plan = resolve_plan({}, allowed=range(100, 108))  # no sysfs topology: each CPU is a core
    assert plan.omp_cpus == tuple(range(100, 107)) and plan.reserved_cpus == (107,)
    plan = resolve_plan({RESERVED_ENV: "3"}, allowed=range(100, 108))
    assert plan.omp_cpus == tuple(range(100, 105)) and plan.reserved_cpus == (105, 106, 107)
    plan = resolve_plan({RESERVED_ENV: "0", NUM_THREADS_ENV: "2"}, allowed=range(100, 108))
    assert plan.omp_cpus == (100, 101) and plan.num_threads == 2 and plan.reserved_cpus == tuple(range(102, 108))


def test_explicit_list_pins_in_order_and_leaves_the_rest():
    plan = resolve_plan({BIND_ENV: "3,1"}, allowed=[0, 1, 2, 3])
    assert plan.omp_cpus == (3, 1) and plan.reserved_cpus == (0, 2) and plan.num_threads == 2 and plan.adaptive
    single = resolve_plan({BIND_ENV: "2"}, allowed=[0, 1, 2, 3])
    assert single.omp_cpus == (2,) and not single.adaptive  # nowhere to move one thread to
    assert not resolve_plan({BIND_ENV: "0-1", ADAPTIVE_ENV: "0"}, allowed=[0, 1]).adaptive


def test_nobind_leaves_threads_alone():
    plan = resolve_plan({BIND_ENV: "nobind"}, allowed=[0, 1])
    assert not plan.pinned and plan.num_threads is None and plan.spawn_env() == {}
    plan = resolve_plan({BIND_ENV: "nobind", NUM_THREADS_ENV: "1"}, allowed=[0, 1])
    assert not plan.pinned and plan.spawn_env() == {"OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({BIND_ENV: "0-3"}, BIND_ENV),  # CPUs 2 and 3 are not in the mask
        ({BIND_ENV: "0|1"}, BIND_ENV),
        ({BIND_ENV: "everything"}, BIND_ENV),
        ({NUM_THREADS_ENV: "3"}, NUM_THREADS_ENV),  # more than the two CPUs auto gives
        ({NUM_THREADS_ENV: "0"}, NUM_THREADS_ENV),
        ({NUM_THREADS_ENV: "two"}, NUM_THREADS_ENV),
        ({RESERVED_ENV: "2"}, RESERVED_ENV),  # leaves no core
        ({RESERVED_ENV: "-1"}, RESERVED_ENV),
        ({ADAPTIVE_ENV: "maybe"}, ADAPTIVE_ENV),
    ],
)
def test_bad_values_name_the_variable(environ, variable):
    with pytest.raises(CpuThreadsConfigError, match=variable):
        resolve_plan(environ, allowed=[0, 1])


# ------------------------------------------------------------------ the governor's decisions
class _CountingPinner(OmpThreadPinner):
    """Records the CPU lists it is asked to pin; pins nothing."""

    def __init__(self) -> None:
        self.pinned: list[list[int]] = []

    @property
    def can_pin(self) -> bool:
        return True

    def pin(self, cpus):
        self.pinned.append(list(cpus))
        return [threading.get_native_id()] * len(cpus)


def test_governor_drops_a_contended_cpu_and_restores_it_once_idle_with_growing_probation():
    plan = CpuThreadPlan("auto", (0, 1, 2), (), 3, True)
    governor = CpuThreadGovernor(plan, _CountingPinner(), probation_s=1.0, drop_wait_fraction=0.2)
    assert governor.decide([0.05, 0.1, 0.05], {}, now=0.0) == [0, 1, 2]  # below the threshold: keep all
    governor.active_cpus = governor.decide([0.05, 0.5, 0.3], {}, now=0.0)
    assert governor.active_cpus == [0, 2]  # the most contended one goes, one at a time
    assert governor.decide([0.0, 0.0], {1: 0.05}, now=0.5) == [0, 2]  # idle, but still on probation
    assert governor.decide([0.0, 0.0], {1: 0.95}, now=1.5) == [0, 2]  # the neighbour is still there
    governor.active_cpus = governor.decide([0.0, 0.0], {1: 0.05}, now=1.5)
    assert governor.active_cpus == [0, 1, 2]  # back, in plan order
    governor.active_cpus = governor.decide([0.0, 0.6, 0.0], {}, now=2.0)
    assert governor.active_cpus == [0, 2]
    assert governor.decide([0.0, 0.0], {1: 0.0}, now=3.5) == [0, 2]  # second drop: two seconds of probation
    assert governor.decide([0.0, 0.0], {1: 0.0}, now=4.1) == [0, 1, 2]


def test_governor_keeps_the_last_cpu_and_moves_the_first_thread_off_a_contended_one():
    plan = CpuThreadPlan("auto", (0, 1), (), 2, True)
    governor = CpuThreadGovernor(plan, _CountingPinner())
    governor.active_cpus = governor.decide([0.7, 0.0], {}, now=0.0)
    assert governor.active_cpus == [1]  # thread 0 now runs on CPU 1
    assert governor.decide([0.9], {0: 1.0}, now=10.0) == [1]  # never fewer than one
    assert governor.decide([0.5], {0: 0.4}, now=10.0) == [1]  # not clearly freer: stay
    governor.active_cpus = governor.decide([0.5], {0: 0.1}, now=10.0)
    assert governor.active_cpus == [0]  # the neighbour moved to CPU 1: the last thread follows the free CPU


def test_governor_ignores_waits_of_threads_that_hardly_ran(monkeypatch):
    plan = CpuThreadPlan("auto", (0, 1), (), 2, True)
    clock = [0.0]
    pinner = _CountingPinner()
    governor = CpuThreadGovernor(plan, pinner, interval_s=1.0, clock=lambda: clock[0])
    samples = iter([[(0, 0), (0, 0)], [(10**9, 0), (1000, 9000)]])  # thread 1: 10 us in a second
    monkeypatch.setattr(cpu_governor, "thread_wait_times", lambda tids: next(samples))
    monkeypatch.setattr(cpu_governor, "cpu_busy_times", dict)
    governor.start()
    clock[0] = 1.5
    governor.after_step()
    assert governor.active_cpus == [0, 1] and pinner.pinned == [[0, 1]]


# ------------------------------------------------------------------ real pinning, in this process
@pytest.fixture
def restore_threads():
    import torch

    mask, count = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    torch.set_num_threads(count)
    place_other_threads((), sorted(mask))


@pytest.mark.skipif(not TWO_CPUS, reason="needs two CPUs")
def test_pinner_pins_each_openmp_thread_to_its_cpu(restore_threads):
    import torch

    pinner = OmpThreadPinner()
    assert pinner.can_pin  # torch's CPU build loads libgomp
    cpus = sorted(os.sched_getaffinity(0))[:2][::-1]
    tids = pinner.pin(cpus)
    assert torch.get_num_threads() == 2
    assert tids[0] == threading.get_native_id() and len(set(tids)) == 2
    assert [os.sched_getaffinity(tid) for tid in tids] == [{cpus[0]}, {cpus[1]}]
    torch.ones(1 << 16).mul(2).sum()  # torch's own parallel regions keep working on the pinned pool


@pytest.mark.skipif(not TWO_CPUS, reason="needs two CPUs")
def test_governor_repins_for_real_when_a_cpu_is_contended(monkeypatch, restore_threads):
    import torch

    first, second = sorted(os.sched_getaffinity(0))[:2]
    clock = [0.0]
    governor = CpuThreadGovernor(CpuThreadPlan("auto", (first, second), (), 2, True), clock=lambda: clock[0])
    # (run ns, wait ns) per thread: at start, after the interval (thread 1 waited half the time it wanted to
    # run), and after the re-pin.
    samples = iter([[(0, 0), (0, 0)], [(10**9, 0), (10**9, 10**9)], [(0, 0)]])
    monkeypatch.setattr(cpu_governor, "thread_wait_times", lambda tids: next(samples))
    governor.start()
    assert torch.get_num_threads() == 2 and os.sched_getaffinity(governor.tids[1]) == {second}
    clock[0] = 1.0
    governor.after_step()
    assert governor.active_cpus == [first] and torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == {first}


# ------------------------------------------------------------------ the engine-core process
def _thread_cpus(pid: int) -> dict[int, str]:
    cpus = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            line = next(line for line in f if line.startswith("Cpus_allowed_list"))
        cpus[int(tid)] = line.split(":")[1].strip()
    return cpus


def _generate_in_engine_process(monkeypatch, bind: str) -> tuple[dict[int, str], int]:
    """Starts an engine process with ``bind``, generates, and returns its threads' CPU lists and its pid."""
    from vllite import LLM, SamplingParams
    from vllite.assets import default_model_path

    monkeypatch.setenv(BIND_ENV, bind)
    monkeypatch.setenv(ADAPTIVE_ENV, "0")  # on a loaded machine the governor may rightly move threads meanwhile
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(str(default_model_path()))
    try:
        out = llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        pid = llm.llm_engine.engine_core.resources.proc.pid
        return _thread_cpus(pid), pid
    finally:
        llm.shutdown()


@pytest.mark.skipif(not TWO_CPUS, reason="needs two CPUs")
def test_engine_process_threads_pinned_one_per_cpu(monkeypatch, restore_threads):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    threads, pid = _generate_in_engine_process(monkeypatch, f"{second},{first}")
    assert threads[pid] == str(second)  # the busy loop's thread is OpenMP thread 0
    assert [tid for tid, cpus in threads.items() if cpus == str(first)] != []  # OpenMP thread 1
    assert len([tid for tid, cpus in threads.items() if cpus in (str(first), str(second))]) == 2  # two threads


@pytest.mark.skipif(not TWO_CPUS, reason="needs two CPUs")
def test_engine_process_leaves_the_other_cpu_to_io_and_the_frontend(monkeypatch, restore_threads):
    allowed = sorted(os.sched_getaffinity(0))
    second = allowed[1]
    threads, pid = _generate_in_engine_process(monkeypatch, str(second))
    rest = [cpu for cpu in allowed if cpu != second]  # the first CPU alone on a 2-CPU machine
    assert threads[pid] == str(second)  # one torch thread, on the CPU given
    assert rest in [parse_cpu_list(cpus) for tid, cpus in threads.items() if tid != pid]  # the I/O threads
    assert parse_cpu_list(_thread_cpus(os.getpid())[threading.get_native_id()]) == rest  # the frontend keeps off


def test_engine_process_start_sets_passive_waiting_unless_the_user_chose(monkeypatch):
    from vllite.plugins.engine_proc.entry import _prepare_cpu_threads

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv(BIND_ENV, "auto")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's value wins
    plan = _prepare_cpu_threads()
    assert plan.pinned and os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["OMP_NUM_THREADS"] == "1"


def test_bad_value_fails_the_engine_start_naming_the_variable(monkeypatch):
    from vllite import LLM
    from vllite.assets import default_model_path

    monkeypatch.setenv(NUM_THREADS_ENV, "lots")
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")
    with pytest.raises(VlliteError, match=NUM_THREADS_ENV):
        LLM(str(default_model_path()))
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(CpuThreadsConfigError, match=NUM_THREADS_ENV):
        LLM(str(default_model_path()))
