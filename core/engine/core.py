"""``EngineCore``: the in-process schedule → execute → update loop.

The engine core owns the executor (which owns the model and the KV cache) and the scheduler (which owns the
KV-cache manager). ``step()`` runs one iteration and returns the outputs per client index. The multiprocess
engine (``vllite.plugins.engine_proc``) wraps exactly this class behind ZMQ.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Literal

from vllite.config import EngineConfig
from vllite.protocol import EngineCoreOutputs, EngineCoreRequest
from vllite.request import Request, RequestStatus
from vllite.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]


def resolve_executor_class(config: EngineConfig) -> type:
    """The executor plugin for this config: ``config.executor`` by name, else the one named like the device."""
    from vllite.plugin_manager import get_registry, resolve_component

    name = config.executor
    if name == "default" and config.device_config.device not in ("auto", "cpu", "cuda"):
        # ``--device sim`` (or any other registered executor name) selects that executor.
        name = config.device_config.device
    if name not in get_registry("executors") and name == "default":
        return resolve_component("executors", "default")
    return resolve_component("executors", name)


class EngineCore:
    """One engine: an executor and a scheduler, stepped by the caller (in-process) or a busy loop (process)."""

    def __init__(self, config: EngineConfig, *, executor_class: type | None = None, log_stats: bool | None = None):
        from vllite.sched import PauseState, create_scheduler

        self.config = config
        self.log_stats = config.observability_config.log_stats if log_stats is None else log_stats
        executor_class = executor_class or resolve_executor_class(config)
        self.model_executor = executor_class(config)
        try:
            num_blocks = self.model_executor.initialize_kv_cache()
            # An executor with its own clock (the simulated one: virtual time) shares it with the scheduler.
            clock = getattr(self.model_executor, "clock", None)
            clock_kwargs = {"clock": clock} if callable(clock) else {}
            self.scheduler = create_scheduler(config, num_blocks, log_stats=self.log_stats, **clock_kwargs)
        except Exception:
            self.model_executor.shutdown()
            raise
        self._pause_state_cls = PauseState
        self.batch_queue_size = max(1, config.scheduler_config.batch_queue_depth)
        self.batch_queue: deque[tuple[Future, SchedulerOutput]] | None = (
            deque(maxlen=self.batch_queue_size) if self.batch_queue_size > 1 else None
        )
        self._executor_pool = None
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue
        logger.info(
            "Engine core ready: model=%s max_model_len=%d kv_blocks=%d scheduler=%s",
            config.model_config.model,
            config.model_config.max_model_len,
            num_blocks,
            type(self.scheduler).__name__,
        )

    # ------------------------------------------------------------------ requests
    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """Turns a wire request into a scheduler ``Request`` (hashing its blocks); safe off the main thread."""
        return Request.from_engine_core_request(request, self.scheduler.block_hasher)

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        if isinstance(request, EngineCoreRequest):
            request = self.preprocess_add_request(request)
        if request.request_id in getattr(self.scheduler, "requests", {}):
            raise ValueError(f"Request id {request.request_id!r} is already in the engine.")
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ stepping
    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # Called even for an empty step: the executor must still drop finished and preempted requests.
        return self.model_executor.execute_model(scheduler_output)

    def _after_execute(self, model_output: ModelRunnerOutput) -> None:
        if model_output.draft_token_ids:
            self.scheduler.update_draft_token_ids(model_output.draft_token_ids)

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Schedules one batch, runs it, and returns ``({client_index: outputs}, model_executed)``."""
        if not self.scheduler.has_requests():
            return {}, False
        scheduler_output = self.scheduler.schedule()
        model_output = self._execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self._after_execute(model_output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def step_with_batch_queue(self) -> tuple[dict[int, EngineCoreOutputs] | None, bool]:
        """Pipelined step: schedule the next batch while the previous one still executes.

        Schedules and submits a new batch while the queue has room and there is work, and only blocks on the
        oldest batch when the queue is full or nothing new can be scheduled. Returns ``(None, False)`` when it
        submitted a batch without collecting one.
        """
        assert self.batch_queue is not None
        if self._executor_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllite-exec")
        model_executed = False
        if self.scheduler.has_requests() and len(self.batch_queue) < self.batch_queue_size:
            scheduler_output = self.scheduler.schedule()
            # Even an empty step goes through the worker, in order: the executor must drop finished requests,
            # and only one thread may touch the executor's state.
            future = self._executor_pool.submit(self._execute, scheduler_output)
            self.batch_queue.appendleft((future, scheduler_output))
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            if model_executed and len(self.batch_queue) < self.batch_queue_size and not self.batch_queue[-1][0].done():
                return None, True
        if not self.batch_queue:
            return None, model_executed
        future, scheduler_output = self.batch_queue.pop()
        model_output = future.result()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self._after_execute(model_output)
        return outputs, model_executed

    # ------------------------------------------------------------------ utilities (also reachable over RPC)
    def pause_scheduler(self, mode: PauseMode = "abort") -> None:
        """Stops scheduling. ``abort`` aborts everything in flight; ``keep`` freezes requests until resumed.

        (``wait`` — finish in-flight requests first — needs a busy loop and is implemented by the process engine.)
        """
        if mode not in ("abort", "keep", "wait"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}.")
        if mode == "abort":
            self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        if mode == "wait":
            self.scheduler.set_pause_state(self._pause_state_cls.PAUSED_NEW)
        else:
            self.scheduler.set_pause_state(self._pause_state_cls.PAUSED_ALL)

    def resume_scheduler(self) -> None:
        self.scheduler.set_pause_state(self._pause_state_cls.UNPAUSED)

    def is_scheduler_paused(self) -> bool:
        return self.scheduler.pause_state != self._pause_state_cls.UNPAUSED

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.scheduler.reset_prefix_cache(reset_running_requests=reset_running_requests)

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}.")
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("Cannot sleep while requests are in flight; pause the engine first.")
        self.reset_prefix_cache()
        self.model_executor.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.model_executor.wake_up(tags)

    def is_sleeping(self) -> bool:
        return bool(self.model_executor.is_sleeping)

    def get_request_counts(self) -> tuple[int, int]:
        return self.scheduler.get_request_counts()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def get_kv_cache_usage(self) -> float:
        stats = self.scheduler.make_stats()
        return stats.kv_cache_usage if stats is not None else self.scheduler.kv_cache_manager.usage

    def get_engine_info(self) -> dict[str, Any]:
        return {
            "max_model_len": self.config.model_config.max_model_len,
            "num_gpu_blocks": self.config.cache_config.num_gpu_blocks,
            "scheduler": type(self.scheduler).__name__,
            "time": time.time(),
        }

    def shutdown(self) -> None:
        if self._executor_pool is not None:
            self._executor_pool.shutdown(wait=True, cancel_futures=True)
            self._executor_pool = None
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.shutdown()
        executor = getattr(self, "model_executor", None)
        if executor is not None:
            executor.shutdown()
