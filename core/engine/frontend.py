"""The request side shared by ``LLMEngine`` and ``AsyncLLM``: tokenizer, validation, fan-out, output state.

Both frontends turn a prompt into ``EngineCoreRequest``s the same way — tokenize and validate, run every loaded
logits processor's ``validate_params``, give the request a unique internal id, fan ``n > 1`` out into child
requests — and register them with one ``OutputProcessor``. They differ only in how they talk to the engine
(blocking calls or ``await``), so that is all they keep for themselves.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec

from vllite.config import EngineConfig
from vllite.protocol import EngineCoreRequest
from vllite.sampling_params import SamplingParams

PromptType = str | Mapping[str, Any] | list[int]


class Frontend:
    """Prepares requests for the engine core and keeps their output state.

    Build it before the engine client (it loads the tokenizer and the logits-processor classes, so a broken
    plugin or a model folder without a tokenizer fails before a process is started), then call
    :meth:`attach_engine` with the client so the limits the engine settled on (``max_model_len``) are used.
    """

    def __init__(self, config: EngineConfig, *, log_stats: bool = False) -> None:
        from vllite.engine.output_processor import OutputProcessor
        from vllite.engine.tokenizer import get_tokenizer
        from vllite.logits_processor import load_logitsprocs_classes

        self.config = config
        model_config = config.model_config
        self.tokenizer = (
            None
            if model_config.skip_tokenizer_init
            else get_tokenizer(
                model_config.tokenizer or model_config.model, trust_remote_code=model_config.trust_remote_code
            )
        )
        self.logitsproc_classes = load_logitsprocs_classes(config)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=log_stats)
        self.input_processor: Any = None

    def attach_engine(self, engine_core: Any) -> None:
        """Adopts the engine's final ``max_model_len`` and the model's config, then builds the input processor."""
        from vllite.engine.input_processor import InputProcessor

        model_config = self.config.model_config
        if engine_core.max_model_len is not None:
            self.config.set_max_model_len(engine_core.max_model_len)
        if model_config.hf_config is None and model_config.model:
            # The engine core may live in another process; the frontend reads the model's facts (vocabulary
            # size, EOS ids) from its own copy of the config.
            from transformers import AutoConfig

            model_config.hf_config = AutoConfig.from_pretrained(
                model_config.model, local_files_only=True, trust_remote_code=model_config.trust_remote_code
            )
        self.input_processor = InputProcessor(self.config, self.tokenizer)

    def prepare(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        queue: Any = None,
    ) -> list[EngineCoreRequest]:
        """Validates one prompt, registers its output state and returns the request(s) to send to the engine.

        Raises ``ValueError`` for a bad prompt or parameter before anything is registered. ``queue`` (async use)
        receives the request's ``RequestOutput``s.
        """
        from vllite.engine.input_processor import InputProcessor, extract_prompt_text
        from vllite.engine.parallel_sampling import ParentRequest
        from vllite.logits_processor import validate_sampling_params

        request = self.input_processor.process_inputs(
            request_id, prompt, params or SamplingParams(), arrival_time=arrival_time or time.time(), priority=priority
        )
        # Every loaded logits processor checks its per-request arguments now, not mid-batch.
        validate_sampling_params(self.logitsproc_classes, request.params)
        InputProcessor.assign_request_id(request)
        prompt_text = extract_prompt_text(prompt)
        if request.params.n == 1:
            self.output_processor.add_request(request, prompt_text, None, 0, queue)
            return [request]
        parent = ParentRequest(request)
        children = []
        for index in range(request.params.n):
            child_id, child_params = parent.get_child_info(index)
            child = msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
            self.output_processor.add_request(child, prompt_text, parent, index, queue)
            children.append(child)
        return children
