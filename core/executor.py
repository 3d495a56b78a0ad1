"""The executor interface: what the engine core calls to run the model.

An executor owns the model and the KV cache. ``EngineCore`` creates it with the engine config (creation loads
the model and reports a ``ModelInfo``), asks it to size and allocate the KV cache (a ``KVCacheInfo``), then
calls ``execute_model`` once per step with the scheduler's output. The config is never written to: what the
executor learns flows back as these two values. Executors are plugins: they are contributed
through the ``vllite_register_executors`` hook and selected with ``--executor NAME`` (or ``--device``).

This module imports no torch, so ``import vllite.executor`` stays cheap.
"""

from __future__ import annotations

import functools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from vllite.exceptions import ExecutorError, ExecutorFailedError

if TYPE_CHECKING:
    from vllite.config import EngineConfig
    from vllite.platform.cpu_threads import CpuThreadPlan
    from vllite.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

FailureCallback = Callable[[], None]


class ModelInfo(msgspec.Struct, frozen=True):
    """What loading the model settled: the context length it will run and the facts requests are checked against.

    ``max_model_len`` is ``--max-model-len`` when given, else the model's own limit. ``sliding_window`` is set
    only when every attention layer uses that window, so the KV cache may drop blocks behind it.
    ``kv_cache_groups`` is the window of each KV-cache group (``None``: full attention) when the model's layers form
    several (a model mixing sliding-window and full-attention layers): the scheduler then keeps one block table per
    group, sent interleaved (position ``k`` of group ``g`` at ``k * len(kv_cache_groups) + g``).
    """

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    kv_cache_groups: tuple[int | None, ...] = ()
    supported_tasks: tuple[str, ...] = ("generate",)  # a pooling model's: its pooling tasks (vllite.pooling_params)
    # Why this model cannot run a prompt in chunks, or reuse cached prefixes (a pooling model's pooler or an
    # encoder's bidirectional attention needs every position of the prompt in one step); None: it can.
    no_chunked_prefill: str | None = None
    no_prefix_caching: str | None = None
    dtype: str = ""  # the dtype the weights run in, as resolved from --dtype (auto: e.g. "bfloat16"); "": not said


class KVCacheInfo(msgspec.Struct, frozen=True):
    """The KV cache as allocated: its block count, and the context length it can hold (at most the model's)."""

    num_blocks: int
    max_model_len: int
    num_bytes: int = 0  # the memory it takes (0: not said)


class Executor(ABC):
    """Runs the model for the engine core; one instance per engine core.

    Life cycle: ``__init__(config)`` loads the model (``_init_executor`` returns the ``ModelInfo``, kept as
    ``self.model_info``); ``initialize_kv_cache()`` allocates the KV cache and returns a ``KVCacheInfo``; then
    ``execute_model(scheduler_output)`` runs once per step.
    ``execute_model`` raises when the forward pass fails; the engine turns that into an error for the caller.

    Subclasses implement ``_init_executor``, ``initialize_kv_cache``, ``execute_model`` and ``shutdown``; the
    sleep, health and failure-callback plumbing here is usable as is.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._failure_callbacks: list[FailureCallback] = []
        self._sleep_level = 0
        self._failed = False
        self.model_info: ModelInfo = self._init_executor()

    # ------------------------------------------------------------------ to implement
    @abstractmethod
    def _init_executor(self) -> ModelInfo:
        """Loads the model and returns what the engine and the frontend must know about it."""

    @abstractmethod
    def initialize_kv_cache(self) -> KVCacheInfo:
        """Sizes and allocates the KV cache. When the user gave no ``--max-model-len`` and the cache cannot hold
        the model's full context, the context length shrinks to what fits (with a warning naming both)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step: applies the schedule to the persistent batch, runs the model, samples."""

    @abstractmethod
    def shutdown(self) -> None:
        """Releases the model and the KV cache. Safe to call twice."""

    # ------------------------------------------------------------------ shared behaviour
    @property
    def max_concurrent_batches(self) -> int:
        """How many batches may be in flight at once (the engine's batch-queue depth); 1 = synchronous."""
        return 1

    def govern_inprocess_steps(self, engine_core: Any) -> None:
        """Called once by the in-process client, on the caller's thread, before the first step. An executor whose
        model runs on this process's CPU threads may place those threads here (the plan of
        :mod:`vllite.platform.cpu_threads`) and wrap ``engine_core.step_fn``. The default does nothing."""
        return None

    def govern_process_steps(self, engine_core: Any, plan: CpuThreadPlan) -> None:
        """As :meth:`govern_inprocess_steps`, called by an engine-core process on its busy-loop thread with the
        process's ``plan``; the executor may also move the process's other threads to ``plan.reserved_cpus``."""
        return None

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Registers ``callback()``, called once when the executor fails in a way it cannot recover from.

        If the executor already failed, the callback is called immediately.
        """
        if self._failed:
            callback()
        else:
            self._failure_callbacks.append(callback)

    def _report_failure(self) -> None:
        """Marks the executor failed and notifies every registered callback (each at most once)."""
        if self._failed:
            return
        self._failed = True
        callbacks, self._failure_callbacks = self._failure_callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a callback must not mask the failure being reported
                logger.exception("Executor failure callback raised")

    def check_health(self) -> None:
        """Raises ``ExecutorFailedError`` if the executor has failed; returns ``None`` when healthy."""
        if self._failed:
            raise ExecutorFailedError("The executor has failed; see the log above for the cause.")

    @property
    def is_sleeping(self) -> bool:
        """True between ``sleep(level >= 1)`` and the ``wake_up`` that restores everything."""
        return self._sleep_level > 0

    def sleep(self, level: int = 1) -> None:
        """Frees device memory: level 1 offloads the weights and discards the KV cache; level 2 discards both.

        Level 0 is a no-op (scheduling-only pause, handled by the engine core). Sleeping twice is a no-op.
        """
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}.")
        if level == 0 or self.is_sleeping:
            return
        self._sleep(level)
        self._sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores what ``sleep`` freed; ``tags`` (``"weights"``, ``"kv_cache"``) restore a part, None = all."""
        if not self.is_sleeping:
            return
        self._wake_up(tags)

    def _sleep(self, level: int) -> None:
        """Executor-specific part of ``sleep``; the default keeps everything in place."""
        logger.info("%s does not free memory on sleep(level=%d)", type(self).__name__, level)

    def _wake_up(self, tags: list[str] | None) -> None:
        """Executor-specific part of ``wake_up``; must reset ``_sleep_level`` to 0 when fully awake."""
        self._sleep_level = 0

    # ------------------------------------------------------------------ collective RPC and profiling
    @property
    def rpc_workers(self) -> tuple[Any, ...]:
        """What :meth:`collective_rpc` calls, one object per worker. An executor that runs its model in this process
        is its own one worker (the default); one that drives worker processes returns their handles. With a worker
        extension class (vLLM's ``--worker-extension-cls``, ``parallel_config.worker_extension_cls``), the worker is an
        instance of that class whose missing attributes are the executor's."""
        worker = self.__dict__.get("_rpc_worker")
        if worker is None:
            worker = self.__dict__["_rpc_worker"] = _extended_worker(self)
        return (worker,)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Calls ``method`` on every worker (:attr:`rpc_workers`) and returns their results in worker order, as
        vLLM's ``collective_rpc``.

        ``method`` is the name of a public worker method, or a callable run as ``method(worker, *args, **kwargs)``
        (in-process only: nothing is pickled across the engine-process boundary). A name no worker method has is a
        ``ValueError`` that says so. ``timeout`` (seconds) bounds the whole call: the workers here run in this
        thread and cannot be interrupted, so a call that overruns finishes and then raises ``TimeoutError``.
        """
        if timeout is not None and timeout <= 0:
            raise ValueError(f"collective_rpc timeout must be > 0 seconds, got {timeout!r}.")
        kwargs = dict(kwargs or {})
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        for worker in self.rpc_workers:
            results.append(_resolve_worker_method(worker, method)(*args, **kwargs))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"collective_rpc {_method_name(method)!r} took longer than {timeout} s.")
        return results

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Starts (``is_start``) or stops the profiler of every worker; a stop writes the trace. The default
        executor profiles with ``torch.profiler`` into ``$VLLITE_TORCH_PROFILER_DIR``; this base has no profiler."""
        raise ExecutorError(f"{type(self).__name__} has no profiler.")


class _WorkerView:
    """The executor seen as a worker: attributes the extension class lacks are the executor's."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executor, name)


def _extended_worker(executor: Executor) -> Any:
    """The executor, or the executor behind the configured worker extension class (``pkg.mod:Class``, vLLM's
    ``parallel_config.worker_extension_cls``)."""
    path = getattr(getattr(executor.config, "parallel_config", None), "worker_extension_cls", "")
    if not path:
        return executor
    from vllite.registry import resolve_class_path

    extension = resolve_class_path(path)
    worker_class = type(f"{extension.__name__}Worker", (extension, _WorkerView), {})
    return worker_class(executor)


def _method_name(method: str | Callable[..., Any]) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


def _resolve_worker_method(worker: Any, method: str | Callable[..., Any]) -> Callable[..., Any]:
    """The bound callable ``method`` names on ``worker``; a private, missing or non-callable name is a ValueError."""
    if callable(method):
        return functools.partial(method, worker)
    if not isinstance(method, str) or not method:
        raise ValueError(f"collective_rpc method must be a method name or a callable, got {method!r}.")
    target = None if method.startswith("_") else getattr(worker, method, None)
    if not callable(target):
        raise ValueError(f"The worker ({type(worker).__name__}) has no worker method {method!r}.")
    return target
