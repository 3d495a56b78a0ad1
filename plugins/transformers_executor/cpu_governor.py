"""Applying a ``CpuThreadPlan`` (``vllite.platform.cpu_threads``): torch's OpenMP threads pinned one per CPU,
and moved off CPUs another process uses.

Pinning runs one OpenMP parallel region through the OpenMP runtime torch itself loaded (``GOMP_parallel``, which
libgomp and LLVM's/Intel's runtimes all export) with a ``ctypes`` callback: each thread of the team (the same
pool torch's ``parallel_for`` uses, since the team size is torch's thread count) pins itself with
``os.sched_setaffinity(0, {cpu})`` and reports its thread id. Thread counts are per calling thread in OpenMP, so
everything here must run on the thread that runs the model.

Adaptivity: an OpenMP region ends at a barrier, so a step takes as long as its slowest thread; a thread that
shares its core with a busy process runs about half the time and holds every other thread at each barrier.
``CpuThreadGovernor.after_step`` looks, at most every ``interval_s``, at how long each engine thread waited for
its CPU (the run-queue delay in ``/proc/thread-self/task/<tid>/schedstat``). A CPU whose thread waited more than
``drop_wait_fraction`` of its time is dropped: one thread fewer, the rest re-pinned. A dropped CPU comes back
when ``/proc/stat`` shows it mostly idle for a whole interval, after a probation that doubles each time the same
CPU has to be dropped again (so a neighbour that comes and goes does not make the engine flap). A last thread whose
CPU is shared moves to the least busy CPU of the plan when that one is clearly freer.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllite.platform.cpu_threads import CpuThreadPlan, place_other_threads

logger = logging.getLogger(__name__)

_OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
SWAP_MARGIN = 0.15  # a lone thread moves only to a CPU this much less busy than the share it waits for
_MIN_ACTIVITY = 0.05  # a thread that ran (or waited) less than this share of an interval says nothing


def _loaded_openmp_library() -> str | None:
    """The path of the OpenMP runtime loaded in this process (torch's), from ``/proc/self/maps``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                name = os.path.basename(path)
                if path.startswith("/") and any(name.startswith(lib) for lib in _OPENMP_LIBRARIES):
                    return path
    except OSError:
        return None
    return None


class OmpThreadPinner:
    """Sets torch's thread count and pins OpenMP thread *i* to ``cpus[i]`` (see the module docstring)."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        path = _loaded_openmp_library()
        self._lib: Any = None
        if path is not None:
            lib = ctypes.CDLL(path)
            if hasattr(lib, "GOMP_parallel") and hasattr(lib, "omp_get_thread_num"):
                lib.omp_get_thread_num.restype = ctypes.c_int
                lib.GOMP_parallel.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
                lib.GOMP_parallel.restype = None
                self._lib = lib
        if self._lib is None:
            logger.warning("No OpenMP runtime with GOMP_parallel found: torch threads are counted, not pinned.")

    @property
    def can_pin(self) -> bool:
        """Whether each OpenMP thread can be pinned (otherwise only the calling thread is)."""
        return self._lib is not None

    def set_num_threads(self, count: int) -> None:
        """``torch.set_num_threads(count)`` for the calling thread, nothing pinned."""
        self._torch.set_num_threads(count)

    def pin(self, cpus: Sequence[int]) -> list[int]:
        """``torch.set_num_threads(len(cpus))`` and thread *i* on ``cpus[i]``; returns the thread ids by index."""
        self._torch.set_num_threads(len(cpus))
        if self._lib is None:
            os.sched_setaffinity(0, set(cpus))
            return [threading.get_native_id()]
        tids = [0] * len(cpus)
        lib = self._lib

        def pin_this_thread(_: Any) -> None:
            index = lib.omp_get_thread_num()
            if 0 <= index < len(cpus):
                os.sched_setaffinity(0, {cpus[index]})
                tids[index] = threading.get_native_id()

        callback = _CALLBACK(pin_this_thread)
        lib.GOMP_parallel(callback, None, len(cpus), 0)
        return tids


def thread_wait_times(tids: Sequence[int]) -> list[tuple[int, int]]:
    """(ns on a CPU, ns waiting in a run queue) of each thread of this process (0, 0 where unreadable)."""
    times = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run_ns, wait_ns, _ = f.read().split()
            times.append((int(run_ns), int(wait_ns)))
        except (OSError, ValueError):
            times.append((0, 0))
    return times


def cpu_busy_times() -> dict[int, tuple[int, int]]:
    """(busy ticks, total ticks) of each CPU since boot, from ``/proc/stat`` (empty if unreadable)."""
    result: dict[int, tuple[int, int]] = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3].isdigit():
                    name, *fields = line.split()
                    ticks = [int(x) for x in fields]
                    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
                    result[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    except (OSError, ValueError, IndexError):
        return {}
    return result


class CpuThreadGovernor:
    """Pins the engine's threads per a ``CpuThreadPlan`` and keeps them off contended CPUs (module docstring)."""

    def __init__(
        self,
        plan: CpuThreadPlan,
        pinner: OmpThreadPinner | None = None,
        *,
        interval_s: float = 0.5,
        drop_wait_fraction: float = 0.3,
        restore_busy_fraction: float = 0.5,
        probation_s: float = 1.0,
        max_probation_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plan = plan
        self.pinner = pinner if pinner is not None else OmpThreadPinner()
        self.interval_s = interval_s
        self.drop_wait_fraction = drop_wait_fraction
        self.restore_busy_fraction = restore_busy_fraction
        self.probation_s = probation_s
        self.max_probation_s = max_probation_s
        self._clock = clock
        self.active_cpus: list[int] = list(plan.omp_cpus)
        self.tids: list[int] = []
        self._drops: dict[int, int] = {}
        self._dropped_until: dict[int, float] = {}
        self._next_check = 0.0
        self._last_threads: list[tuple[int, int]] = []
        self._last_cpus: dict[int, tuple[int, int]] = {}

    def start(self) -> None:
        """Applies the plan on the calling thread (the one that runs the model)."""
        if self.plan.pinned:
            self._repin()
        elif self.plan.num_threads is not None:
            self.pinner.set_num_threads(self.plan.num_threads)
        logger.info("CPU threads: %s", self.plan.describe())

    def place_others(self) -> None:
        """Moves the process's other threads (I/O, ZMQ, watchers) onto the reserved CPUs, if there are any."""
        if self.plan.pinned and self.plan.reserved_cpus:
            place_other_threads(self.tids, self.plan.reserved_cpus)

    def _repin(self) -> None:
        self.tids = self.pinner.pin(self.active_cpus)
        self._last_threads = thread_wait_times(self.tids)
        self._last_cpus = cpu_busy_times()
        self._next_check = self._clock() + self.interval_s

    def after_step(self) -> None:
        """Called after each engine step on the model's thread; re-plans at most every ``interval_s``."""
        if not self.plan.adaptive or not self.pinner.can_pin:
            return
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + self.interval_s
        threads = thread_wait_times(self.tids)
        cpus = cpu_busy_times()
        floor_ns = self.interval_s * 1e9 * _MIN_ACTIVITY
        waits = [
            (w1 - w0) / ((r1 - r0) + (w1 - w0)) if (r1 - r0) + (w1 - w0) > floor_ns else 0.0
            for (r0, w0), (r1, w1) in zip(self._last_threads, threads)
        ]
        busy = {
            cpu: (b1 - self._last_cpus[cpu][0]) / max(1, t1 - self._last_cpus[cpu][1])
            for cpu, (b1, t1) in cpus.items()
            if cpu in self._last_cpus
        }
        self._last_threads, self._last_cpus = threads, cpus
        new_active = self.decide(waits, busy, now)
        if new_active != self.active_cpus:
            logger.info("CPU threads: %s -> %s (wait %s)", self.active_cpus, new_active, [f"{w:.2f}" for w in waits])
            self.active_cpus = new_active
            self._repin()

    def _put_on_probation(self, cpu: int, now: float) -> None:
        self._drops[cpu] = self._drops.get(cpu, 0) + 1
        hold = min(self.max_probation_s, self.probation_s * 2 ** (self._drops[cpu] - 1))
        self._dropped_until[cpu] = now + hold

    def decide(self, waits: Sequence[float], busy: dict[int, float], now: float) -> list[int]:
        """The CPUs to use next, from each active thread's run-queue wait fraction and each CPU's busy fraction
        over the last interval. Pure: no thread is touched."""
        active = list(self.active_cpus)
        worst = max(range(len(waits)), key=lambda i: waits[i], default=None)
        if worst is not None and waits[worst] > self.drop_wait_fraction:
            if len(active) > 1:
                self._put_on_probation(active.pop(worst), now)
                return active
            # One thread left, and its CPU is shared: move it to the least busy CPU of the plan if it would get
            # clearly more time there than the share it gets here.
            idle = sorted((busy.get(cpu, 1.0), cpu) for cpu in self.plan.omp_cpus if cpu not in active)
            if idle and idle[0][0] < waits[worst] - SWAP_MARGIN:
                self._put_on_probation(active[0], now)
                return [idle[0][1]]
            return active  # no CPU is clearly freer: adding one beside a contended thread would not help
        for cpu in self.plan.omp_cpus:
            if cpu in active or now < self._dropped_until.get(cpu, 0.0):
                continue
            if busy.get(cpu, 1.0) < self.restore_busy_fraction:
                active.append(cpu)
        return [cpu for cpu in self.plan.omp_cpus if cpu in active]


def govern_engine_core(engine_core: Any, plan: CpuThreadPlan, *, caller_thread: bool = False) -> CpuThreadGovernor:
    """Applies ``plan`` on the calling thread (the one that steps ``engine_core``) and makes the engine's chosen
    step function (``EngineCore.step_fn``) call the governor after each step.

    ``caller_thread``: the engine steps in the user's thread (in-process), so that thread is pinned only while
    it steps and gets its own affinity mask back in between; threads and processes it starts are not confined to
    the engine's first CPU.
    """
    governor = CpuThreadGovernor(plan)
    home = os.sched_getaffinity(0)
    governor.start()
    pin_in_step = caller_thread and plan.pinned
    if pin_in_step:
        os.sched_setaffinity(0, home)
    step_fn = engine_core.step_fn

    def governed_step() -> Any:
        if pin_in_step:
            os.sched_setaffinity(0, {governor.active_cpus[0]})
        try:
            result = step_fn()
            governor.after_step()
        finally:
            if pin_in_step:
                os.sched_setaffinity(0, home)
        return result

    engine_core.step_fn = governed_step
    return governor
