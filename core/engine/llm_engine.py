"""``LLMEngine``: the synchronous frontend — tokenize, submit, step, detokenize.

It ties the ``InputProcessor`` (prompt → ``EngineCoreRequest``), an engine client (in-process or ZMQ) and the
``OutputProcessor`` (``EngineCoreOutput`` → ``RequestOutput``), with ``n > 1`` fanned out into child requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllite.config import EngineConfig
from vllite.engine.input_processor import PromptType
from vllite.engine_args import EngineArgs
from vllite.lora import LoRARequest
from vllite.outputs import RequestOutput
from vllite.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Adds requests and steps the engine; ``step()`` returns the ``RequestOutput``s that changed."""

    def __init__(
        self, config: EngineConfig, *, log_stats: bool | None = None, multiprocess: bool | None = None
    ) -> None:
        from vllite.engine.core_client import make_client
        from vllite.engine.frontend import Frontend, load_frontend_parts

        self.config = config
        log_stats = config.observability_config.log_stats if log_stats is None else log_stats
        tokenizer, logitsproc_classes = load_frontend_parts(config)
        self.engine_core = make_client(config, multiprocess=multiprocess, log_stats=log_stats)
        self.engine_info = self.engine_core.engine_info
        self.frontend = Frontend(config, self.engine_info, tokenizer, logitsproc_classes, log_stats=log_stats)
        self.tokenizer = self.frontend.tokenizer
        self.input_processor = self.frontend.input_processor
        self.output_processor = self.frontend.output_processor

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> LLMEngine:
        return cls(engine_args.create_engine_config(), **kwargs)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        resumable: bool = False,
    ) -> str:
        """Validates and submits one prompt; returns the request id. Raises ``ValueError`` on bad input.

        ``resumable``: the prompt is the first input chunk of a session (``vllite.engine.sessions``): each turn's
        outputs end with its finish reason and ``finished`` False; :meth:`add_session_input` appends the next chunk
        and :meth:`close_session_input` ends the input.
        """
        prepared = self.frontend.prepare(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time,
            priority=priority,
            lora_request=lora_request,
            resumable=resumable,
        )
        for request in prepared:
            self.engine_core.add_request(request)
        return request_id

    def add_session_input(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        """Sends the next input chunk of the open session ``request_id``; its turn starts once the running turn (if
        any) ends. ``params`` None: the previous turn's. ``SessionClosedError`` (a ``ValueError``) when the session is
        not open."""
        engine_id = self.output_processor.session_engine_id(request_id)
        self.engine_core.add_request(self.frontend.prepare_session_chunk(engine_id, prompt, params))

    def close_session_input(self, request_id: str) -> None:
        """Ends the input of the open session ``request_id``: once its running turn (if any) ends, the session
        finishes (its last output has ``finished`` True) and the engine frees its KV."""
        engine_id = self.output_processor.session_engine_id(request_id)
        self.engine_core.add_request(self.frontend.prepare_session_chunk(engine_id, None))

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        internal = self.output_processor.abort_requests(ids)
        self.engine_core.abort_requests(internal)

    def abort_all_requests(self) -> None:
        """Aborts every request in flight (used when a call fails half-way, so the engine stays usable)."""
        internal = self.output_processor.abort_requests(list(self.output_processor.request_states), internal=True)
        if internal:
            self.engine_core.abort_requests(internal)

    def step(self) -> list[RequestOutput]:
        """Runs (or waits for) one engine step and returns the outputs it produced."""
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ------------------------------------------------------------------ utilities
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.engine_core.call_utility("reset_prefix_cache", reset_running_requests)

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pauses scheduling: ``abort`` in-flight requests (they finish with ABORT), ``wait`` for them to finish,
        or ``keep`` them frozen; returns once paused. New requests queue until :meth:`resume_scheduler`."""
        self.engine_core.call_utility("pause_scheduler", mode, clear_cache)

    def resume_scheduler(self) -> None:
        self.engine_core.call_utility("resume_scheduler")

    def is_scheduler_paused(self) -> bool:
        return self.engine_core.call_utility("is_scheduler_paused")

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pauses (``mode``, as :meth:`pause_scheduler`) and frees memory (level 1: weights offloaded, KV cache
        discarded; level 2: both discarded); returns once the engine sleeps. Levels 1 and 2 need
        ``enable_sleep_mode=True`` (``ValueError`` otherwise, as vLLM)."""
        from vllite.engine.core import check_sleep_mode

        check_sleep_mode(self.config, "sleep", level=level)
        self.engine_core.call_utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        from vllite.engine.core import check_sleep_mode

        check_sleep_mode(self.config, "wake_up", tags=[t for t in tags or () if t != "scheduling"])
        self.engine_core.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.call_utility("is_sleeping")

    # LoRA adapters, by their lora_int_id (vLLM's names).
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine_core.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine_core.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return set(self.engine_core.call_utility("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        return self.engine_core.call_utility("pin_lora", lora_id)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Starts ``torch.profiler`` in the engine (traces go to ``$VLLITE_TORCH_PROFILER_DIR``)."""
        self.engine_core.call_utility("profile", True, profile_prefix)

    def stop_profile(self) -> None:
        """Stops the engine's profiler; the trace is written when this returns."""
        self.engine_core.call_utility("profile", False, None)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Calls ``method`` (a worker method's name, or in-process a callable ``fn(worker, *args, **kwargs)``) on
        every worker of every engine; their results in order (vLLM's ``collective_rpc``)."""
        results = self.engine_core.call_utility("collective_rpc", method, timeout, tuple(args), kwargs)
        if self.config.parallel_config.data_parallel_size > 1:  # one list per engine
            return [result for engine_results in results for result in engine_results]
        return list(results)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
