"""Starting the engine cores of a data-parallel client as local processes, each on its own CPUs.

Each engine is an ``MPClient`` of its own (process, sockets, handshake, output thread, death watch) whose outputs
go to the data-parallel client's merged stream. All N processes are started first and then handshaken, so their
model loads overlap; if any fails, every one is stopped and one ``EngineStartupError`` names the engine and the
cause.

CPUs: with ``VLLITE_CPU_OMP_THREADS_BIND=auto`` (the default) the CPUs ``auto`` would give one engine are split
into ``data_parallel_size`` contiguous groups, engine *r* on group *r* (with fewer CPUs than engines, engine *r*
gets CPU ``r mod n``); ``VLLITE_CPU_NUM_THREADS`` then caps each engine's threads. As in vLLM, an explicit list may
give each rank its own list, separated by ``|`` (``0-3|4-7``); a single list (or ``nobind``) applies to every
engine. Each engine's process keeps all its threads on its own CPUs; the frontend keeps to the CPUs ``auto``
reserved from the engines (none on a machine of fewer than four cores).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from vllite.config import EngineConfig
from vllite.exceptions import CpuThreadsConfigError, EngineClientUsageError, EngineStartupError
from vllite.platform.cpu_threads import BIND_ENV, NUM_THREADS_ENV, CpuThreadPlan, confine_frontend, resolve_plan
from vllite.protocol import EngineCoreOutputs

from .client import MPClient

Sink = Callable[[EngineCoreOutputs | BaseException], None]


class DPEngineClient(MPClient):
    """One engine core of a data-parallel client: an ``MPClient`` whose outputs go to a given sink."""

    def __init__(self, config: EngineConfig, sink: Sink, **kwargs: Any) -> None:
        self._sink = sink
        super().__init__(config, **kwargs)

    def _make_output_sink(self) -> Sink:
        return self._sink

    def get_output(self) -> EngineCoreOutputs:
        raise EngineClientUsageError("A data-parallel engine's outputs are read through its DPClient.")


def engine_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config engine ``rank`` runs with (its ``data_parallel_rank`` set)."""
    parallel = dataclasses.replace(config.parallel_config, data_parallel_rank=rank)
    return dataclasses.replace(config, parallel_config=parallel)


def engine_cpu_overrides(num_engines: int, environ: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Per engine, the ``VLLITE_CPU_OMP_THREADS_BIND`` it runs with (see the module docstring); an empty dict
    leaves the engine the frontend's setting. Raises ``CpuThreadsConfigError`` for a ``|`` list of the wrong
    length."""
    env = dict(os.environ if environ is None else environ)
    bind = env.get(BIND_ENV, "").strip() or "auto"
    if "|" in bind:
        parts = [part.strip() for part in bind.split("|")]
        if len(parts) != num_engines:
            raise CpuThreadsConfigError(
                f"{BIND_ENV}={bind!r} gives {len(parts)} CPU lists for data_parallel_size={num_engines}"
            )
        return [{BIND_ENV: part} for part in parts]
    if bind != "auto":
        return [{} for _ in range(num_engines)]
    env.pop(NUM_THREADS_ENV, None)  # the pool to split is every CPU auto would use; the cap applies per engine
    cpus = list(resolve_plan(env).omp_cpus)
    if not cpus:
        return [{} for _ in range(num_engines)]
    if len(cpus) < num_engines:
        groups = [[cpus[rank % len(cpus)]] for rank in range(num_engines)]
    else:
        size, extra = divmod(len(cpus), num_engines)
        groups, start = [], 0
        for rank in range(num_engines):
            end = start + size + (1 if rank < extra else 0)
            groups.append(cpus[start:end])
            start = end
    return [{BIND_ENV: ",".join(str(cpu) for cpu in group)} for group in groups]


def frontend_plan(environ: dict[str, str] | None = None) -> CpuThreadPlan | None:
    """With ``auto``, the plan whose engine CPUs are all the engines' groups together (so the frontend keeps to
    the CPUs reserved from them); None otherwise."""
    env = dict(os.environ if environ is None else environ)
    if (env.get(BIND_ENV, "").strip() or "auto") != "auto":
        return None
    env.pop(NUM_THREADS_ENV, None)
    return resolve_plan(env)


def start_local_engines(
    config: EngineConfig,
    sinks: Sequence[Sink],
    *,
    log_stats: bool | None = None,
    executor_class: type | None = None,
) -> list[DPEngineClient]:
    """Starts ``len(sinks)`` engine processes together and waits until all are ready (engine *r* sends its
    outputs to ``sinks[r]``). On any failure every engine is stopped and ``EngineStartupError`` raised."""
    num_engines = len(sinks)
    overrides = engine_cpu_overrides(num_engines)
    engines: list[DPEngineClient] = []
    rank = 0
    try:
        for rank in range(num_engines):
            engine = DPEngineClient(
                engine_config(config, rank),
                sinks[rank],
                log_stats=log_stats,
                executor_class=executor_class,
                engine_index=rank,
                env_overrides=overrides[rank],
                deferred=True,
            )
            engines.append(engine)
            engine.start_engine()
        for engine in engines:
            rank = engine.engine_index
            engine.wait_until_ready()
        plan = frontend_plan()
        if plan is not None:
            confine_frontend(plan)  # onto the CPUs auto left out of every engine's group, if any
    except BaseException as exc:
        stop_engines(engines)
        if isinstance(exc, Exception):
            raise EngineStartupError(
                f"Data-parallel engine core {rank} (of {num_engines}) failed to start: {exc}"
            ) from exc
        raise
    return engines


def stop_engines(engines: Sequence[MPClient]) -> None:
    """Stops every engine at once (each client's shutdown on its own thread: they drain in parallel, and none
    sees another's exit as a death). At interpreter exit (an ``LLM`` collected by its finalizer) they stop one after
    another on this thread: a thread started then never runs, and waiting for it would hang the exit."""
    if sys.is_finalizing():
        for engine in engines:
            engine.shutdown()
        return
    threads = [threading.Thread(target=engine.shutdown, name="VLLiteDPShutdown", daemon=True) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
