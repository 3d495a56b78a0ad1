"""``EngineCore``: the schedule → execute → update loop, and the engine's pause and sleep semantics.

The engine core owns the executor (which owns the model and the KV cache) and the scheduler (which owns the
KV-cache manager). ``step()`` runs one iteration and returns the outputs per client index. It reports what it
settled on at start-up as an ``EngineInfo``. The multiprocess engine (``vllite.plugins.engine_proc``) holds
one of these and feeds it from its I/O threads; in-process, the caller steps it directly. Pause and sleep
mean the same in both: a call that must wait for the engine to drain returns a ``Future`` completed by the
step that drains it.
"""

from __future__ import annotations

import gc
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from vllite.config import EngineConfig, executor_name
from vllite.engine.request_checks import check_request
from vllite.exceptions import VlliteError
from vllite.lora import LoRARequest
from vllite.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInfo, FinishReason
from vllite.request import Request, RequestStatus
from vllite.sched import PauseState, create_scheduler
from vllite.sched.async_scheduler import create_async_scheduler
from vllite.sched.output import ModelRunnerOutput, SchedulerOutput
from vllite.structured_output.manager import create_structured_output_manager

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor


logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]


def resolve_executor_class(config: EngineConfig) -> type:
    """The executor plugin for this config: ``config.executor`` by name, else the one named like the device."""
    from vllite.plugin_manager import get_registry, resolve_component

    name = executor_name(config.executor, config.device_config.device)
    if name not in get_registry("executors") and name == "default":
        return resolve_component("executors", "default")
    return resolve_component("executors", name)


def make_step_wrappers(config: EngineConfig, scheduler: Any) -> list[Any]:
    """One of each registered step wrapper (hook ``vllite_register_step_wrappers``) for an engine core."""
    from vllite.plugin_manager import get_registry

    return [wrapper_class(config, scheduler) for wrapper_class in get_registry("step_wrappers").values()]


def check_sleep_mode(config: EngineConfig, method: str, level: int = 1, tags: list[str] | None = None) -> None:
    """vLLM's rule: ``sleep`` (levels 1, 2) and ``wake_up`` of ``weights`` / ``kv_cache`` need an engine started with
    ``enable_sleep_mode=True`` (``--enable-sleep-mode``); ``ValueError`` otherwise. Level 0 (a pause) and a plain
    ``wake_up()`` (resume; nothing can be asleep) are always allowed."""
    frees_memory = level > 0 if method == "sleep" else bool(tags)
    if config.model_config.enable_sleep_mode or not frees_memory:
        return
    what = f"sleep(level={level})" if method == "sleep" else f"wake_up(tags={tags})"
    raise ValueError(
        f"{what} needs sleep mode: start the engine with enable_sleep_mode=True (vllite serve --enable-sleep-mode)."
    )


class EngineCore:
    """One engine: an executor and a scheduler, stepped by the caller (in-process) or a busy loop (process).

    ``self.config`` is the caller's config with the limits the engine settled on (``EngineConfig.with_limits``);
    ``self.info`` reports them. Requests that end outside a step (a pause that aborts them) get their finish
    outputs with the next ``step()``.
    """

    def __init__(self, config: EngineConfig, *, executor_class: type | None = None, log_stats: bool | None = None):
        self.log_stats = config.observability_config.log_stats if log_stats is None else log_stats
        executor_class = executor_class or resolve_executor_class(config)
        self.model_executor = executor_class(config)
        try:
            self.info, self.config = self._settle_limits(config)
            # An executor with its own clock (the simulated one: virtual time) shares it with the scheduler.
            clock = getattr(self.model_executor, "clock", None)
            self.async_scheduling = self.config.scheduler_config.async_scheduling
            make_scheduler = create_async_scheduler if self.async_scheduling else create_scheduler
            groups = self.model_executor.model_info.kv_cache_groups  # a model mixing sliding and full layers
            self.scheduler = make_scheduler(
                self.config,
                self.info.num_gpu_blocks,
                sliding_window=self.info.sliding_window,
                log_stats=self.log_stats,
                **({"clock": clock} if callable(clock) else {}),
                **({"kv_cache_groups": groups} if groups else {}),
            )
        except Exception:
            self.model_executor.shutdown()
            raise
        self.info = msgspec.structs.replace(self.info, scheduler=type(self.scheduler).__name__)
        self.structured_output_manager = create_structured_output_manager(
            self.config, self.info.vocab_size, list(self.info.eos_token_ids)
        )
        self._pending_finishes: list[Request] = []
        self._pending_errors: list[tuple[Request, str]] = []  # rejected requests, with the reason
        self._kv_event_pool: Any = None  # the block pool whose events are published (with --kv-events-config)
        self.kv_event_publisher = self._make_kv_event_publisher()
        self._drain_waiters: list[Future] = []
        self.batch_queue_size = max(1, config.scheduler_config.batch_queue_depth)
        if self.async_scheduling:
            # Step N+1 is scheduled while step N runs (output placeholders): exactly two batches in flight, so at
            # most one step's tokens are unknown when the scheduler plans (vllite.sched.async_scheduler).
            self.batch_queue_size = 2
        self.batch_queue: deque[tuple[Future, SchedulerOutput]] | None = (
            deque(maxlen=self.batch_queue_size) if self.batch_queue_size > 1 else None
        )
        self._executor_pool: ThreadPoolExecutor | None = None
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue
        # Entered around each step's execution (hook vllite_register_step_wrappers; builtin: the failed step's dump).
        self.step_wrappers = make_step_wrappers(self.config, self.scheduler)
        # The start-up heap (modules, weights, the KV cache's bookkeeping) never becomes garbage: frozen, the
        # collector stops walking it, and a full collection during serving takes milliseconds, not 100-200 ms.
        gc.collect()
        gc.freeze()
        self._log_ready()

    def _log_ready(self) -> None:
        """The one start-up line (as vLLM's): the resolved dtype, the context length and the KV cache's capacity."""
        info = self.info
        groups = self.model_executor.model_info.kv_cache_groups
        # A grouped model's block holds one group's share of the layers, and a position takes a block per group.
        layout = f" in {len(groups)} groups (windows {list(groups)})" if groups else ""
        logger.info(
            "Engine core ready: model=%s dtype=%s max_model_len=%d KV cache: %d blocks%s / %d tokens / %s "
            "(kv_cache_dtype=%s) scheduler=%s",
            self.config.model_config.model, info.dtype or "?", info.max_model_len, info.num_gpu_blocks, layout,
            info.num_gpu_blocks * info.block_size, _gib(self._kv_cache_bytes), self.config.cache_config.kv_cache_dtype,
            info.scheduler,
        )  # fmt: skip

    def _settle_limits(self, config: EngineConfig) -> tuple[EngineInfo, EngineConfig]:
        model_info = self.model_executor.model_info
        kv_cache = self.model_executor.initialize_kv_cache()
        self._kv_cache_bytes = kv_cache.num_bytes
        config = config.for_model(model_info.no_chunked_prefill, model_info.no_prefix_caching)
        engine_config = config.with_limits(kv_cache.max_model_len, kv_cache.num_blocks, dtype=model_info.dtype or None)
        info = EngineInfo(
            max_model_len=kv_cache.max_model_len,
            num_gpu_blocks=kv_cache.num_blocks,
            block_size=config.cache_config.block_size,
            max_num_batched_tokens=engine_config.scheduler_config.max_num_batched_tokens or 0,
            vocab_size=model_info.vocab_size,
            eos_token_ids=model_info.eos_token_ids,
            sliding_window=model_info.sliding_window,
            supported_tasks=model_info.supported_tasks,
            hidden_size=config.model_config.get_hidden_size(),
            enable_prompt_embeds=config.model_config.enable_prompt_embeds,
            dtype=model_info.dtype,
        )
        return info, engine_config

    # ------------------------------------------------------------------ requests
    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """Turns a wire request into a scheduler ``Request`` (hashing its blocks); safe off the main thread."""
        return Request.from_engine_core_request(request, self.scheduler.block_hasher)

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        """Checks the request against the engine's limits and queues it in the scheduler.

        A request that fails the checks, or whose arrival a scheduler plugin fails on, is rejected: its ERROR
        finish output, with the reason, comes with the next ``step()``; the engine goes on. Only a duplicate id
        raises (``ValueError``): an output for that id would end the live request of the same id.
        """
        if isinstance(request, EngineCoreRequest):
            request = self.preprocess_add_request(request)
        if request.continuation:
            self._add_session_chunk(request)
            return
        if request.request_id in getattr(self.scheduler, "requests", {}):
            raise ValueError(f"Request id {request.request_id!r} is already in the engine.")
        try:
            check_request(request, self.info)
            if request.lora_request is not None:
                self.add_lora(request.lora_request)  # loaded and checked now: a bad adapter fails this request
            if request.use_structured_output and request.structured_output_request is None:
                self.structured_output_manager.grammar_init(request)  # compiles while the request waits
            self.scheduler.add_request(request)
        except Exception as exc:
            message = str(exc) if isinstance(exc, (ValueError, VlliteError)) else f"{type(exc).__name__}: {exc}"
            logger.error("Rejected request %r: %s", request.request_id, message)
            self._pending_errors.append((request, message))

    def _add_session_chunk(self, chunk: Request) -> None:
        """The next input chunk of a live session; one for a session that is not open is rejected (an ERROR output
        for that id), as is one too long for the session's context (which ends the session)."""
        try:
            if chunk.resumable:
                check_request(chunk, self.info, session_chunk=True)
            self.scheduler.add_session_chunk(chunk)
        except (ValueError, VlliteError) as exc:
            logger.error("Rejected input chunk of session %r: %s", chunk.request_id, exc)
            self._pending_errors.append((chunk, str(exc)))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Aborts requests the client gave up on (it already knows: no finish output is sent)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def abort_all_requests(self) -> dict[int, EngineCoreOutputs]:
        """Aborts every request in the engine and returns their ABORT finish outputs, per client."""
        return _finish_outputs(self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED) or [], [])

    def has_work(self) -> bool:
        """Whether ``step()`` has anything to do: requests to run, batches in flight, outputs or waiters due."""
        return (
            self.scheduler.has_requests()
            or bool(self.batch_queue)
            or bool(self._pending_finishes)
            or bool(self._pending_errors)
            or bool(self._drain_waiters)
        )

    def has_client_work(self) -> bool:
        """:meth:`has_work` less the finished requests whose blocks a KV connector still holds for another engine
        (a prefill engine's KV no decode engine fetched yet): nobody waits on those here, so a shutdown gives them
        up instead of waiting for them."""
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self.batch_queue)
            or bool(self._pending_finishes)
            or bool(self._pending_errors)
            or bool(self._drain_waiters)
        )

    # ------------------------------------------------------------------ stepping
    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # Called even for an empty step: the executor must still drop finished and preempted requests.
        with ExitStack() as wrapped:
            for wrapper in self.step_wrappers:
                wrapped.enter_context(wrapper.around(scheduler_output))
            return self.model_executor.execute_model(scheduler_output)

    def _after_execute(self, model_output: ModelRunnerOutput) -> None:
        if model_output.draft_token_ids:
            self.scheduler.update_draft_token_ids(model_output.draft_token_ids)

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Schedules one batch, runs it, and returns ``({client_index: outputs}, model_executed)``."""
        if not self.scheduler.has_requests():
            return self._end_step({}), False
        self.structured_output_manager.update_waiting(self.scheduler)
        scheduler_output = self.scheduler.schedule()
        self.structured_output_manager.start_grammar_bitmask(self.scheduler, scheduler_output)
        model_output = self._execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self._after_execute(model_output)
        return self._end_step(outputs), scheduler_output.total_num_scheduled_tokens > 0

    def step_with_batch_queue(self) -> tuple[dict[int, EngineCoreOutputs] | None, bool]:
        """Pipelined step: schedule the next batch while the previous one still executes.

        Without async scheduling a request whose output is still in flight is not scheduled again until it
        arrives; with it (``--async-scheduling``) the scheduler schedules its next decode on an output placeholder
        (:mod:`vllite.sched.async_scheduler`), so the model runs every step back to back.
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
            self.structured_output_manager.update_waiting(self.scheduler)
            scheduler_output = self.scheduler.schedule()
            # A constrained request is never in two batches in flight (with async scheduling it waits for its
            # token: vllite.sched.async_placeholders), so its matcher is up to date here.
            self.structured_output_manager.start_grammar_bitmask(self.scheduler, scheduler_output)
            # Even an empty step goes through the worker, in order: the executor must drop finished requests,
            # and only one thread may touch the executor's state.
            future = self._executor_pool.submit(self._execute, scheduler_output)
            self.batch_queue.appendleft((future, scheduler_output))
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            if model_executed and len(self.batch_queue) < self.batch_queue_size and not self.batch_queue[-1][0].done():
                return None, True
        if not self.batch_queue:
            return self._end_step({}), model_executed
        future, scheduler_output = self.batch_queue.pop()
        model_output = future.result()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self._after_execute(model_output)
        return self._end_step(outputs), model_executed

    def _make_kv_event_publisher(self) -> Any:
        """The KV-cache event publisher ``--kv-events-config`` names (a plugin: hook
        ``vllite_register_kv_event_publishers``), with the block pool recording; ``None`` if off."""
        from vllite.plugin_manager import resolve_component

        events_config = self.config.kv_events_config
        manager = getattr(self.scheduler, "kv_cache_manager", None)
        if events_config is None or not events_config.enabled:
            return None
        if manager is None:
            raise ValueError(
                f"kv_events_config: the scheduler {type(self.scheduler).__name__} has no KV cache manager."
            )
        publisher_class = resolve_component("kv_event_publishers", events_config.publisher)
        publisher = publisher_class(events_config, self.config.parallel_config.data_parallel_rank)
        self._kv_event_pool = manager.block_pool
        self._kv_event_pool.enable_kv_cache_events(self.config.cache_config.block_size)
        return publisher

    def _publish_kv_events(self) -> None:
        """Publishes the KV-cache events recorded since the previous call (with ``--kv-events-config``)."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self._kv_event_pool.take_events())

    def _end_step(self, outputs: dict[int, EngineCoreOutputs]) -> dict[int, EngineCoreOutputs]:
        """Adds the finish outputs of requests ended between steps, and completes drain waiters once drained;
        publishes the step's KV-cache events."""
        self._publish_kv_events()
        if self._pending_finishes or self._pending_errors:
            pending = _finish_outputs(self._pending_finishes, self._pending_errors)
            for client_index, extra in pending.items():
                merged = outputs.setdefault(client_index, EngineCoreOutputs())
                merged.outputs.extend(extra.outputs)
                merged.finished_requests = (merged.finished_requests or set()) | (extra.finished_requests or set())
            self._pending_finishes, self._pending_errors = [], []
        if self._drain_waiters and not self.scheduler.has_unfinished_requests() and not self.batch_queue:
            waiters, self._drain_waiters = self._drain_waiters, []
            for waiter in waiters:
                waiter.set_result(None)
        return outputs

    # ------------------------------------------------------------------ pause / sleep (also reachable over RPC)
    def pause_scheduler(self, mode: PauseMode = "abort", clear_cache: bool = True) -> Future | None:
        """Stops scheduling, as vLLM's ``pause_generation``.

        ``abort``: abort everything in flight (each request finishes with ABORT); ``wait``: admit nothing new
        and let running requests finish; ``keep``: freeze every request in place until resumed. Returns
        ``None`` when the engine is paused already, else a ``Future`` that the step draining the engine completes
        (only ``wait`` has to drain). ``clear_cache`` resets the prefix cache once paused.
        """
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode!r} (expected 'abort', 'wait' or 'keep').")
        if mode == "abort":
            self._pending_finishes.extend(self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED) or [])
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW)
        after_pause = self._reset_prefix_cache_quietly if clear_cache else None
        if mode == "keep" or (not self.scheduler.has_unfinished_requests() and not self.batch_queue):
            return _then(None, after_pause)
        drained: Future = Future()
        self._drain_waiters.append(drained)
        return _then(drained, after_pause)

    def resume_scheduler(self) -> None:
        """Schedules again; ``ValueError`` while the executor sleeps (a step would find no weights or KV cache)."""
        if self.is_sleeping():
            raise ValueError("The engine is asleep: wake_up() (POST /wake_up) restores it and resumes scheduling.")
        self.scheduler.set_pause_state(PauseState.UNPAUSED)

    def is_scheduler_paused(self) -> bool:
        return self.scheduler.pause_state != PauseState.UNPAUSED

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        done = self.scheduler.reset_prefix_cache(reset_running_requests=reset_running_requests)
        self._publish_kv_events()  # subscribers hear of the reset now, not at the next step
        return done

    def _reset_prefix_cache_quietly(self) -> None:
        if not self.reset_prefix_cache(False):
            logger.info("Prefix cache not reset: requests still hold blocks (paused with mode='keep').")

    def sleep(self, level: int = 1, mode: PauseMode = "abort") -> Future | None:
        """Pauses (``mode``, as ``pause_scheduler``), then frees memory: level 0 only pauses, 1 offloads the
        weights and discards the KV cache, 2 discards both. Requests kept frozen (``keep``) recompute their KV
        after ``wake_up``. Returns ``None`` once asleep, or a ``Future`` completed when the engine has drained
        and slept."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}.")
        check_sleep_mode(self.config, "sleep", level=level)
        paused = self.pause_scheduler(mode, clear_cache=False)
        if level == 0:
            return paused
        return _then(paused, lambda: self._sleep_executor(level))

    def _sleep_executor(self, level: int) -> None:
        self.scheduler.reset_prefix_cache(reset_running_requests=True)  # the KV cache is about to go
        self.model_executor.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores what ``sleep`` freed (``tags`` select parts), then resumes scheduling once nothing sleeps: a
        partial wake-up (``["weights"]``) waits for the rest. ``["scheduling"]`` alone only resumes."""
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags:
            check_sleep_mode(self.config, "wake_up", tags=tags)
        if tags is None or tags:
            self.model_executor.wake_up(tags)
        if tags == [] or not self.is_sleeping():
            self.resume_scheduler()

    def is_sleeping(self) -> bool:
        return bool(self.model_executor.is_sleeping)

    # ------------------------------------------------------------------ LoRA adapters (vLLM's utilities)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads and checks an adapter into the executor's host cache; False when it is already loaded."""
        if not isinstance(lora_request, LoRARequest):  # over RPC: its fields, in order
            lora_request = msgspec.convert(lora_request, LoRARequest)
        return self._lora_executor().add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unloads an adapter; ``ValueError`` while unfinished requests use it (they finish first)."""
        users = [
            r.request_id
            for r in getattr(self.scheduler, "requests", {}).values()
            if r.lora_request and r.lora_request.lora_int_id == lora_id and not r.is_finished()
        ]
        if users:
            raise ValueError(
                f"LoRA adapter {lora_id} is in use by {len(users)} unfinished request(s); remove it once they finish."
            )
        return self._lora_executor().remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora_executor().list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Keeps an adapter loaded: never evicted from the host cache."""
        return self._lora_executor().pin_lora(lora_id)

    def _lora_executor(self) -> Any:
        if self.config.lora_config is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True (--enable-lora).")
        return self.model_executor

    # ------------------------------------------------------------------ profiling and worker RPC (vLLM's names)
    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Starts (``is_start``) or stops the executor's profiler; a stop writes the trace."""
        self.model_executor.profile(is_start, profile_prefix)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Calls ``method`` on every worker of the executor; the results in worker order."""
        return self.model_executor.collective_rpc(method, timeout, tuple(args), kwargs)

    # ------------------------------------------------------------------ facts (also reachable over RPC)
    def get_request_counts(self) -> tuple[int, int]:
        return self.scheduler.get_request_counts()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def get_kv_cache_usage(self) -> float:
        # Not through make_stats(): that hands out (and resets) the per-step prefix-cache and preemption deltas.
        return self.scheduler.get_kv_cache_usage()

    def get_engine_info(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self.info)

    def shutdown(self) -> None:
        """Stops the grammar threads, the executor pool, the scheduler and the executor; unfreezes the heap."""
        manager = getattr(self, "structured_output_manager", None)
        if manager is not None:
            manager.shutdown()
        publisher = getattr(self, "kv_event_publisher", None)
        if publisher is not None:
            publisher.shutdown()
        if self._executor_pool is not None:
            self._executor_pool.shutdown(wait=True, cancel_futures=True)
            self._executor_pool = None
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.shutdown()
        executor = getattr(self, "model_executor", None)
        if executor is not None:
            executor.shutdown()
        gc.unfreeze()  # what this engine held can be collected again


def _finish_outputs(aborted: list[Request], rejected: list[tuple[Request, str]]) -> dict[int, EngineCoreOutputs]:
    """Finish outputs for requests ended outside a step (ABORT, or ERROR with the reason), grouped by client."""
    by_client: dict[int, EngineCoreOutputs] = {}
    finishes = [(r, FinishReason.ABORT, None) for r in aborted] + [(r, FinishReason.ERROR, e) for r, e in rejected]
    for request, reason, error in finishes:
        outputs = by_client.setdefault(request.client_index, EngineCoreOutputs(finished_requests=set()))
        outputs.outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=reason, error=error))
        assert outputs.finished_requests is not None
        outputs.finished_requests.add(request.request_id)
    return by_client


def _then(future: Future | None, action: Callable[[], None] | None) -> Future | None:
    """Runs ``action`` once ``future`` completes (at once when it is ``None``), passing failures on."""
    if action is None or future is None:
        if action is not None:
            action()
        return future
    chained: Future = Future()

    def run(done: Future) -> None:
        try:
            done.result()
            action()
            chained.set_result(None)
        except Exception as exc:
            chained.set_exception(exc)

    future.add_done_callback(run)
    return chained


def _gib(num_bytes: int) -> str:
    """A memory size for a log line: GiB with two decimals, MiB below a tenth of a GiB."""
    if num_bytes >= 2**30 // 10:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"
