"""Which cores the engine's torch/OpenMP threads use: ``VLLITE_CPU_OMP_THREADS_BIND`` and its companions.

``resolve_plan()`` reads the variables (and the process's affinity mask) into a ``CpuThreadPlan``; nothing here
imports torch, so the plan can be made in the frontend and in the engine-core process before torch loads. The plan
is the contract between the processes: the executor applies it to the threads that run its model (the transformers
executor pins torch's OpenMP threads and governs them, ``vllite.plugins.transformers_executor.cpu_governor``), the
engine process moves its other threads onto ``reserved_cpus`` and the frontend keeps off the engine's CPUs
(:func:`place_other_threads`, :func:`confine_frontend`).

``VLLITE_CPU_OMP_THREADS_BIND`` (as vLLM's ``VLLM_CPU_OMP_THREADS_BIND``):

* ``auto`` (default): one logical CPU per physical core of the affinity mask, minus the last
  ``VLLITE_CPU_NUM_OF_RESERVED_CPU`` cores, left to the frontend and the I/O threads. Unset, one core is reserved
  when the mask has at least ``AUTO_RESERVE_MIN_CORES`` cores (with fewer, every core computes).
* ``0-3``, ``0,2``, ``0-3,6``: exactly these CPUs, OpenMP thread *i* on the *i*-th; the rest of the mask is left to
  the frontend and the I/O threads.
* ``nobind``: threads are left where the OS puts them (``VLLITE_CPU_NUM_THREADS`` still sets their number).

``VLLITE_CPU_NUM_THREADS`` caps the number of torch threads (the first N CPUs of the list). With
``VLLITE_CPU_ADAPTIVE_THREADS=1`` (default) the engine moves its threads off a core another process is using and
back when it is free again. A value that cannot be used raises ``CpuThreadsConfigError`` naming the variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vllite.exceptions import CpuThreadsConfigError

BIND_ENV = "VLLITE_CPU_OMP_THREADS_BIND"
NUM_THREADS_ENV = "VLLITE_CPU_NUM_THREADS"
RESERVED_ENV = "VLLITE_CPU_NUM_OF_RESERVED_CPU"
ADAPTIVE_ENV = "VLLITE_CPU_ADAPTIVE_THREADS"
AUTO_RESERVE_MIN_CORES = 4
# Threads of a pinned engine wait passively: a spinning OpenMP thread burns the core another process needs, and
# one that sleeps at once is what lets the busy loop's threads and the neighbour share a core without stalls.
WAIT_POLICY_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class CpuThreadPlan:
    """Where the engine's torch threads go.

    ``omp_cpus[i]`` is the CPU of OpenMP thread *i* (empty with ``nobind``); ``reserved_cpus`` are the CPUs of the
    affinity mask left to the frontend and the I/O threads; ``num_threads`` is the torch thread count to set
    (``None``: torch's own default).
    """

    bind: str
    omp_cpus: tuple[int, ...]
    reserved_cpus: tuple[int, ...]
    num_threads: int | None
    adaptive: bool

    @property
    def pinned(self) -> bool:
        """Whether each OpenMP thread is pinned to one CPU."""
        return bool(self.omp_cpus)

    def spawn_env(self) -> dict[str, str]:
        """Variables an engine-core process needs before it loads torch (its OpenMP runtime reads them once)."""
        env: dict[str, str] = {}
        if self.num_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.num_threads)
        if self.pinned:
            env.update(WAIT_POLICY_ENV)
        return env

    def describe(self) -> str:
        """One line for the log."""
        if not self.pinned:
            threads = "torch's default" if self.num_threads is None else str(self.num_threads)
            return f"{BIND_ENV}={self.bind!r}: threads not pinned, {threads} torch threads"
        return (
            f"{BIND_ENV}={self.bind!r}: {len(self.omp_cpus)} torch threads pinned to CPUs {list(self.omp_cpus)}, "
            f"CPUs {list(self.reserved_cpus)} left to the frontend and I/O, adaptive={self.adaptive}"
        )


def parse_cpu_list(text: str, variable: str = BIND_ENV) -> list[int]:
    """``"0-3,6"`` → ``[0, 1, 2, 3, 6]``, in the order given; a malformed list, an empty or reversed range, a
    negative or repeated CPU raises ``CpuThreadsConfigError`` naming ``variable``."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        bounds = part.split("-")
        try:
            if len(bounds) == 1:
                first = last = int(bounds[0])
            elif len(bounds) == 2:
                first, last = int(bounds[0]), int(bounds[1])
            else:
                raise ValueError(part)
        except ValueError:
            raise CpuThreadsConfigError(
                f"{variable}={text!r}: {part!r} is not a CPU number or a range like 0-3 "
                "(expected 'auto', 'nobind', or a list such as '0-3' or '0,2,4')"
            ) from None
        if first < 0 or last < first:
            raise CpuThreadsConfigError(f"{variable}={text!r}: {part!r} is not a valid CPU range")
        for cpu in range(first, last + 1):
            if cpu in cpus:
                raise CpuThreadsConfigError(f"{variable}={text!r}: CPU {cpu} is listed twice")
            cpus.append(cpu)
    return cpus


def physical_core_cpus(allowed: Iterable[int], sysfs: str = "/sys/devices/system/cpu") -> list[int]:
    """One logical CPU (the lowest) per physical core among ``allowed``, sorted; a CPU whose topology cannot be
    read counts as a core of its own."""
    first_of_core: dict[tuple[str, str] | int, int] = {}
    for cpu in sorted(set(allowed)):
        try:
            base = f"{sysfs}/cpu{cpu}/topology"
            with open(f"{base}/physical_package_id") as f_pkg, open(f"{base}/core_id") as f_core:
                key: tuple[str, str] | int = (f_pkg.read().strip(), f_core.read().strip())
        except OSError:
            key = cpu
        first_of_core.setdefault(key, cpu)
    return sorted(first_of_core.values())


def _int_variable(environ: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise CpuThreadsConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise CpuThreadsConfigError(f"{name}={raw!r} must be at least {minimum}")
    return value


def _bool_variable(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise CpuThreadsConfigError(f"{name}={raw!r} must be 1 or 0")


def resolve_plan(environ: Mapping[str, str] | None = None, allowed: Iterable[int] | None = None) -> CpuThreadPlan:
    """The plan for this process, from ``environ`` (default ``os.environ``) and the CPUs it may run on (default
    its affinity mask). Raises ``CpuThreadsConfigError`` (a ``ValueError``) naming the variable at fault."""
    environ = os.environ if environ is None else environ
    allowed_cpus = sorted(set(os.sched_getaffinity(0) if allowed is None else allowed))
    bind = environ.get(BIND_ENV, "").strip() or "auto"
    num_threads = _int_variable(environ, NUM_THREADS_ENV, 1)
    reserve = _int_variable(environ, RESERVED_ENV, 0)
    adaptive = _bool_variable(environ, ADAPTIVE_ENV, True)
    if bind == "nobind":
        return CpuThreadPlan(bind, (), (), num_threads, False)
    if bind == "auto":
        cores = physical_core_cpus(allowed_cpus)
        if reserve is None:
            reserve = 1 if len(cores) >= AUTO_RESERVE_MIN_CORES else 0
        if reserve >= len(cores):
            raise CpuThreadsConfigError(
                f"{RESERVED_ENV}={reserve} leaves no core for the engine: this process may use "
                f"{len(cores)} core(s) (CPUs {allowed_cpus})"
            )
        omp = cores[: len(cores) - reserve]
    else:
        if "|" in bind:
            raise CpuThreadsConfigError(
                f"{BIND_ENV}={bind!r}: vllite runs one engine per process, give a single CPU list (no '|')"
            )
        omp = parse_cpu_list(bind)
        outside = [cpu for cpu in omp if cpu not in allowed_cpus]
        if outside:
            raise CpuThreadsConfigError(
                f"{BIND_ENV}={bind!r}: CPU(s) {outside} are not in this process's affinity mask {allowed_cpus}"
            )
    if num_threads is not None:
        if num_threads > len(omp):
            raise CpuThreadsConfigError(
                f"{NUM_THREADS_ENV}={num_threads} is more than the {len(omp)} CPU(s) {BIND_ENV}={bind!r} gives "
                f"the engine ({omp})"
            )
        omp = omp[:num_threads]
    reserved = tuple(cpu for cpu in allowed_cpus if cpu not in omp)
    return CpuThreadPlan(bind, tuple(omp), reserved, len(omp), adaptive and len(omp) > 1)


def place_other_threads(keep: Sequence[int], cpus: Sequence[int]) -> int:
    """Moves every thread of this process except ``keep`` onto ``cpus`` (the frontend / I/O CPUs); returns how
    many were moved. Threads that exit meanwhile are skipped."""
    moved = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid in keep:
            continue
        try:
            os.sched_setaffinity(tid, set(cpus))
            moved += 1
        except OSError:
            continue
    return moved


def confine_frontend(plan: CpuThreadPlan) -> None:
    """The frontend of a multiprocess engine keeps off the engine's CPUs: with reserved CPUs, every thread of
    this process moves onto them; torch, where this process loaded it, uses as many threads as it has CPUs."""
    if not plan.pinned:
        return
    if plan.reserved_cpus:
        place_other_threads((), plan.reserved_cpus)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(max(1, len(plan.reserved_cpus)))
