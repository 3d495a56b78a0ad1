"""``AsyncLLM``: the asyncio frontend. Many concurrent ``generate()`` streams share one engine process.

One output-handler task per event loop pulls ``EngineCoreOutputs`` from the ``AsyncMPClient``, runs the
``OutputProcessor`` (detokenize, stop strings, n > 1) and puts each ``RequestOutput`` into its request's
``RequestOutputCollector``; each ``generate()`` iterator reads only its own collector. Cancelling an iterator
(task cancellation or ``aclose()``) aborts the request in the engine. If the engine dies, every open iterator
raises ``EngineDeadError``; after ``shutdown()`` every open iterator raises ``EngineClientClosedError``. With
data parallel (``data_parallel_size`` > 1) one engine's death ends only the streams it served, with
``EngineDeadError``. If the output of one request cannot be processed (its detokenizer, stop strings or logprobs
raise), that iterator alone raises ``RequestProcessingError`` and the request is aborted in the engine; the other
streams go on.

``stat_loggers`` (``stat_loggers.StatLogger``s, or factories that build one from the ``EngineInfo``, e.g.
the server's Prometheus logger) get each batch's ``SchedulerStats`` and ``IterationStats`` from the output handler;
giving any turns stats on in the engine. A logger that raises is logged once and skipped for that batch; the
streams go on.

    llm = AsyncLLM(model="path/to/model")
    async for out in llm.generate("Hello", SamplingParams(output_kind=RequestOutputKind.DELTA), "req-1"):
        print(out.outputs[0].text, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Sequence
from typing import Any

import msgspec

from vllite.config import EngineConfig
from vllite.engine.input_processor import PromptType
from vllite.engine.sessions import StreamingInput
from vllite.engine.stats import IterationStats
from vllite.engine_args import EngineArgs
from vllite.exceptions import EngineClientClosedError, EngineDeadError, RequestProcessingError
from vllite.lora import LoRARequest
from vllite.outputs import PoolingRequestOutput, RequestOutput
from vllite.plugins.engine_proc.admission import admit
from vllite.plugins.engine_proc.output_handler import call_in_loop, output_handler, record_aborted
from vllite.plugins.engine_proc.stat_loggers import StatLogger, StatLoggerFactory, build_stat_loggers
from vllite.plugins.engine_proc.streaming_input import stream_session
from vllite.pooling_params import PoolingParams
from vllite.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """An asyncio engine: ``AsyncLLM(model=..., **engine_kwargs)`` or ``AsyncLLM.from_engine_args(args)``.

    ``stat_loggers`` receive every batch's stats (and force ``log_stats`` on); without them stats cost nothing. Each
    is a ``StatLogger`` or a factory called once with the ``EngineInfo``; the built loggers are ``self.stat_loggers``.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        log_stats: bool | None = None,
        stat_loggers: Sequence[StatLogger | StatLoggerFactory] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        from vllite.engine.core_client import make_client
        from vllite.engine.frontend import Frontend, load_frontend_parts

        if config is None:
            config = EngineArgs(model=model, **engine_kwargs).create_engine_config()
        elif model is not None or engine_kwargs:
            raise ValueError("Pass either config= or model/engine keyword arguments, not both.")
        self.config = config
        log_stats = config.observability_config.log_stats if log_stats is None else log_stats
        if stat_loggers:
            log_stats = True  # the engine sends SchedulerStats, and the frontend keeps request stats, only then
        tokenizer, logitsproc_classes = load_frontend_parts(config)
        self.engine_core: Any = make_client(config, multiprocess=True, asyncio_mode=True, log_stats=log_stats)
        self.engine_info = self.engine_core.engine_info
        self.stat_loggers = build_stat_loggers(stat_loggers or (), self.engine_info)
        self.frontend = Frontend(config, self.engine_info, tokenizer, logitsproc_classes, log_stats=log_stats)
        self.tokenizer = self.frontend.tokenizer
        self.input_processor = self.frontend.input_processor
        self.output_processor = self.frontend.output_processor
        self._output_handler: asyncio.Task | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(config=engine_args.create_engine_config(), **kwargs)

    # ------------------------------------------------------------------ state
    @property
    def errored(self) -> bool:
        return self.engine_core.is_engine_dead

    @property
    def is_running(self) -> bool:
        return not self.errored and not self.engine_core.resources.closed

    @property
    def dead_error(self) -> BaseException:
        return self.engine_core.resources.dead_error()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Any:
        """Validates and submits one prompt; returns its ``RequestOutputCollector``. ``data_parallel_rank``: the
        data-parallel engine that must serve it (default: the client's router chooses). ``QueueOverflowError`` /
        ``MaxQueuedTokensError`` (HTTP 503) when ``max_num_queued_reqs`` / ``max_num_queued_tokens`` refuse it
        (``vllite.plugins.engine_proc.admission``)."""
        queue, _ = await self._submit(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            lora_request=lora_request,
        )
        return queue

    async def _submit(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
        resumable: bool = False,
    ) -> tuple[Any, list[str]]:
        """:meth:`add_request`, also for a session's first chunk (``resumable``); returns the output queue and the
        engine ids sent."""
        from vllite.plugins.engine_proc.output_collector import RequestOutputCollector

        if self.errored:
            raise self.dead_error
        if self.engine_core.resources.closed:
            raise EngineClientClosedError("AsyncLLM has been shut down.")
        self._ensure_output_handler()
        params = params or self.frontend.default_sampling_params()
        size = self.config.parallel_config.data_parallel_size
        if data_parallel_rank is not None and (
            isinstance(data_parallel_rank, bool)
            or not isinstance(data_parallel_rank, int)
            or not 0 <= data_parallel_rank < size
        ):
            raise ValueError(f"data_parallel_rank must be an integer in [0, {size}), got {data_parallel_rank!r}.")
        # Admission control (--max-num-queued-reqs/-tokens); no await from here until prepare() has registered it.
        n = params.n if isinstance(params, SamplingParams) else 1
        admit(self.config.scheduler_config, self.output_processor, self.stat_loggers, n)
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
        queue = RequestOutputCollector(output_kind=kind, keep_turns=resumable)
        engine_ids = []
        for request in self.frontend.prepare(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time,
            priority=priority,
            queue=queue,
            lora_request=lora_request,
            resumable=resumable,
        ):
            if data_parallel_rank is not None:
                request.data_parallel_rank = data_parallel_rank
            await self.engine_core.add_request_async(request)
            engine_ids.append(request.request_id)
        return queue, engine_ids

    async def generate(
        self,
        prompt: PromptType | AsyncIterable[StreamingInput],
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (DELTA, CUMULATIVE or FINAL_ONLY, per ``sampling_params.output_kind``).

        Cancelling the consuming task, or closing the iterator early, aborts the request in the engine.
        ``data_parallel_rank`` names the data-parallel engine that must serve it. Raises ``EngineDeadError`` if
        the engine (with data parallel: the one serving it) dies, ``EngineClientClosedError`` if ``shutdown()`` is
        called meanwhile, ``RequestProcessingError`` if this request's output cannot be processed (the request is
        aborted; other streams are unaffected), ``ValueError`` for an invalid prompt or parameters.

        ``prompt`` may be an async iterable of ``StreamingInput`` (vLLM's streaming input): a session whose turns
        each append a chunk and generate, keeping the KV in between (``vllite.plugins.engine_proc.streaming_input``).
        """
        if isinstance(prompt, AsyncIterable):  # a session's input chunks
            session = stream_session(
                self,
                prompt,
                sampling_params,
                request_id,
                priority=priority,
                data_parallel_rank=data_parallel_rank,
                lora_request=lora_request,
            )
            async with contextlib.aclosing(session) as outputs:
                async for output in outputs:
                    yield output
            return
        queue = await self.add_request(
            request_id,
            prompt,
            sampling_params,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            lora_request=lora_request,
        )
        async with contextlib.aclosing(self._outputs(queue, request_id)) as outputs:  # closed with this stream
            async for output in outputs:
                yield output

    async def _outputs(self, queue: Any, request_id: str) -> AsyncGenerator[Any, None]:
        """The request's outputs from its queue until the finished one; aborts it if the consumer goes away."""
        finished = False
        try:
            while not finished:
                output = queue.get_nowait() or await queue.get()
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self._abort_now([request_id])
            raise
        except (EngineDeadError, EngineClientClosedError, RequestProcessingError):
            raise  # the request is already gone: dead engine, shut down, or failed and aborted
        except BaseException:
            if not finished:
                self._abort_now([request_id])
            raise

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Runs one pooling request (a pooling model's task in ``pooling_params.task``) and yields its one
        ``PoolingRequestOutput``. Errors and cancellation behave as in :meth:`generate`; a request that failed in
        the engine comes back with ``error`` set."""
        if truncate_prompt_tokens is not None:
            pooling_params = msgspec.structs.replace(pooling_params, truncate_prompt_tokens=truncate_prompt_tokens)
        queue = await self.add_request(
            request_id,
            prompt,
            pooling_params,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            lora_request=lora_request,
        )
        async with contextlib.aclosing(self._outputs(queue, request_id)) as outputs:  # closed with this stream
            async for output in outputs:
                yield output

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """What the model does: ``("generate",)``, or its pooling tasks (``"embed"``, ``"classify"``, ...)."""
        return tuple(self.engine_core.engine_info.supported_tasks)

    async def abort(self, request_id: str | list[str]) -> None:
        """Aborts requests by the ids given to ``generate()``; unknown or finished ids are ignored."""
        self._abort_now([request_id] if isinstance(request_id, str) else list(request_id))

    def _abort_now(self, request_ids: list[str]) -> None:
        stats = IterationStats() if self.stat_loggers else None
        internal = self.output_processor.abort_requests(request_ids, iteration_stats=stats)
        if stats is not None and stats.finished_requests:  # request_success{finished_reason="abort"} and the rest
            record_aborted(self.stat_loggers, stats)
        if internal and not self.errored:
            try:
                self.engine_core.abort_requests(internal)
            except (EngineDeadError, EngineClientClosedError):
                pass  # the engine is gone or shut down: nothing left to abort

    # ------------------------------------------------------------------ the output handler
    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._output_handler
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        # Refer to the parts, not to self, so the AsyncLLM can be garbage-collected while the task runs.
        engine_core, output_processor = self.engine_core, self.output_processor
        handler = output_handler(engine_core, output_processor, self.stat_loggers)
        self._output_handler = loop.create_task(handler, name="vllite-output")

    # ------------------------------------------------------------------ utilities
    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await self.engine_core.call_utility_async("reset_prefix_cache", reset_running_requests)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads a LoRA adapter in every engine; False when it was already loaded."""
        return await self.engine_core.call_utility_async("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.engine_core.call_utility_async("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return set(await self.engine_core.call_utility_async("list_loras"))

    async def pin_lora(self, lora_id: int) -> bool:
        return await self.engine_core.call_utility_async("pin_lora", lora_id)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pauses scheduling (``abort``, ``wait`` or ``keep``, as ``LLMEngine.pause_scheduler``)."""
        await self.engine_core.call_utility_async("pause_scheduler", mode, clear_cache)

    async def resume_generation(self) -> None:
        await self.engine_core.call_utility_async("resume_scheduler")

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pauses (``mode``) and frees memory (``level``); returns once the engine sleeps. Levels 1 and 2 need
        ``enable_sleep_mode=True`` (``ValueError`` otherwise, as vLLM)."""
        from vllite.engine.core import check_sleep_mode

        check_sleep_mode(self.config, "sleep", level=level)
        await self.engine_core.call_utility_async("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        from vllite.engine.core import check_sleep_mode

        check_sleep_mode(self.config, "wake_up", tags=[t for t in tags or () if t != "scheduling"])
        await self.engine_core.call_utility_async("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self.engine_core.call_utility_async("is_sleeping")

    async def call_utility(self, method: str, *args: Any) -> Any:
        return await self.engine_core.call_utility_async(method, *args)

    async def is_paused(self) -> bool:
        """Whether scheduling is paused (:meth:`pause_generation`, or a sleep)."""
        return bool(await self.engine_core.call_utility_async("is_scheduler_paused"))

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        """Starts ``torch.profiler`` in the engine process (traces go to ``$VLLITE_TORCH_PROFILER_DIR``)."""
        await self.engine_core.call_utility_async("profile", True, profile_prefix)

    async def stop_profile(self) -> None:
        """Stops the engine's profiler; the trace is written when this returns."""
        await self.engine_core.call_utility_async("profile", False, None)

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Calls the worker method named ``method`` on every worker of every engine; their results, in order (vLLM's
        ``collective_rpc``). Results cross the process boundary as builtins, tensors, or their ``str()``."""
        results = await self.engine_core.call_utility_async("collective_rpc", method, timeout, tuple(args), kwargs)
        if self.config.parallel_config.data_parallel_size > 1:  # one list per engine
            return [result for engine_results in results for result in engine_results]
        return list(results)

    def shutdown(self) -> None:
        """Stops the output handler and the engine process; idempotent. Every open ``generate()`` stream wakes
        and raises ``EngineClientClosedError``, whichever thread calls this."""
        task, self._output_handler = self._output_handler, None
        loop = task.get_loop() if task is not None else None
        if task is not None and not task.done():
            call_in_loop(loop, task.cancel)
        output_processor = getattr(self, "output_processor", None)
        if output_processor is not None and output_processor.has_unfinished_requests():
            closed = EngineClientClosedError("AsyncLLM was shut down before the request finished.")
            call_in_loop(loop, output_processor.fail_all, closed)
        engine_core = getattr(self, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
