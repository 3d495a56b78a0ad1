"""``LLMEngine``: the synchronous frontend — tokenize, submit, step, detokenize.

It ties the ``InputProcessor`` (prompt → ``EngineCoreRequest``), an engine client (in-process or ZMQ) and the
``OutputProcessor`` (``EngineCoreOutput`` → ``RequestOutput``), with ``n > 1`` fanned out into child requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from vllite.config import EngineArgs, EngineConfig
from vllite.outputs import RequestOutput
from vllite.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Adds requests and steps the engine; ``step()`` returns the ``RequestOutput``s that changed."""

    def __init__(
        self, config: EngineConfig, *, log_stats: bool | None = None, multiprocess: bool | None = None
    ) -> None:
        from vllite.engine.core_client import make_client
        from vllite.engine.input_processor import InputProcessor
        from vllite.engine.output_processor import OutputProcessor
        from vllite.engine.tokenizer import get_tokenizer
        from vllite.logits_processor import load_logitsproc_classes

        self.config = config
        model_config = config.model_config
        self.tokenizer = (
            None
            if model_config.skip_tokenizer_init
            else get_tokenizer(
                model_config.tokenizer or model_config.model, trust_remote_code=model_config.trust_remote_code
            )
        )
        # Loaded here too (not only in the executor) so bad per-request arguments fail at submit time.
        self.logitsproc_classes = load_logitsproc_classes(config)
        self.engine_core = make_client(config, multiprocess=multiprocess, log_stats=log_stats)
        if self.engine_core.max_model_len is not None:
            config.set_max_model_len(self.engine_core.max_model_len)
        if model_config.hf_config is None and model_config.model:
            # The engine core may live in another process; the frontend reads the model's facts (vocabulary
            # size, EOS ids) from its own copy of the config.
            from transformers import AutoConfig

            model_config.hf_config = AutoConfig.from_pretrained(
                model_config.model, local_files_only=True, trust_remote_code=model_config.trust_remote_code
            )
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=bool(log_stats))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> LLMEngine:
        return cls(engine_args.create_engine_config(), **kwargs)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Mapping[str, Any] | list[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Validates and submits one prompt; returns the request id. Raises ``ValueError`` on bad input."""
        from vllite.engine.input_processor import InputProcessor, extract_prompt_text
        from vllite.engine.parallel_sampling import ParentRequest
        from vllite.logits_processor import validate_sampling_params

        params = params or SamplingParams()
        request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time=arrival_time or time.time(), priority=priority
        )
        # Every loaded logits processor checks its per-request arguments now, not mid-batch.
        validate_sampling_params(self.logitsproc_classes, request.params)
        InputProcessor.assign_request_id(request)
        prompt_text = extract_prompt_text(prompt)
        if request.params.n == 1:
            self.output_processor.add_request(request, prompt_text)
            self.engine_core.add_request(request)
            return request_id
        parent = ParentRequest(request)
        for index in range(request.params.n):
            child_id, child_params = parent.get_child_info(index)
            child = msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core.add_request(child)
        return request_id

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
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    def sleep(self, level: int = 1) -> None:
        self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine_core.wake_up(tags)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
