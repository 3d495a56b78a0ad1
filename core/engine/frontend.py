"""The request side shared by ``LLMEngine`` and ``AsyncLLM``: tokenizer, validation, fan-out, output state.

Both frontends turn a prompt into ``EngineCoreRequest``s the same way — tokenize and validate against what the
engine reported, run every loaded logits processor's ``validate_params``, give the request its engine id, fan
``n > 1`` out into child requests — and register them with one ``OutputProcessor``. They differ only in how they
talk to the engine (blocking calls or ``await``), so that is all they keep for themselves.

Request ids: the caller's id (``RequestOutput.request_id``; need not be unique) and the engine id the frontend
gives each request, ``f"{request_id}-{8 hex digits}"`` (``VLLITE_DISABLE_REQUEST_ID_RANDOMIZATION=1``: the
caller's id as is); the children of ``n > 1`` are ``f"{engine_id}-{index}"``.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import msgspec

from vllite.config import EngineConfig, ModelConfig
from vllite.engine.input_processor import PromptType
from vllite.lora import LoRARequest
from vllite.pooling_params import PoolingParams
from vllite.protocol import EngineCoreRequest, EngineInfo
from vllite.sampling_params import SamplingParams

DISABLE_ID_RANDOMIZATION_ENV = "VLLITE_DISABLE_REQUEST_ID_RANDOMIZATION"
# generation_config.json fields that become default sampling parameters (vLLM's ``--generation-config auto``).
GENERATION_CONFIG_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_frontend_parts(config: EngineConfig) -> tuple[Any, list[type]]:
    """The tokenizer and the logits-processor classes, loaded before an engine starts: a scheduler setting the
    scheduler cannot serve, a broken plugin or a model folder without a tokenizer fails here, before a process is
    spawned."""
    from vllite.engine.tokenizer import get_tokenizer
    from vllite.exceptions import ModelLoadError
    from vllite.logits_processor import load_logitsprocs_classes
    from vllite.model_files import check_model_folder
    from vllite.sched.async_scheduler import check_async_scheduling

    if config.scheduler_config.async_scheduling:
        check_async_scheduling(config)  # the scheduler's own check, before anything loads
    model_config = config.model_config
    if model_config.skip_tokenizer_init:
        return None, load_logitsprocs_classes(config)
    tokenizer_path = model_config.tokenizer or model_config.model
    assert tokenizer_path is not None, "EngineArgs.create_engine_config always sets the model folder"
    try:
        tokenizer = get_tokenizer(tokenizer_path, trust_remote_code=model_config.trust_remote_code)
    except ModelLoadError:
        if tokenizer_path == model_config.model:  # a missing model, or a folder that is not one, says so
            check_model_folder(tokenizer_path)
        raise
    return tokenizer, load_logitsprocs_classes(config)


def engine_request_id(request_id: str) -> str:
    """The engine id of a request: unique even when callers reuse ``request_id``."""
    if os.environ.get(DISABLE_ID_RANDOMIZATION_ENV, "0") not in ("", "0", "false", "False"):
        return request_id
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


def default_sampling_fields(model_config: ModelConfig) -> dict[str, Any]:
    """The sampling defaults the model's generation config sets (``--generation-config``: ``auto`` = the model
    folder, ``vllm`` = none, else a folder), as ``SamplingParams`` keyword arguments."""
    from vllite.model_files import load_generation_config

    source = model_config.generation_config
    if source == "vllm":
        return {}
    values = load_generation_config(model_config.model if source == "auto" else source)
    return {name: values[key] for key, name in GENERATION_CONFIG_SAMPLING_FIELDS.items() if values.get(key) is not None}


class Frontend:
    """Prepares requests for the engine core and keeps their output state; built once the engine has started,
    from the config, the engine's ``EngineInfo`` and the parts :func:`load_frontend_parts` loaded."""

    def __init__(
        self,
        config: EngineConfig,
        engine_info: EngineInfo,
        tokenizer: Any,
        logitsproc_classes: list[type],
        *,
        log_stats: bool = False,
    ) -> None:
        from vllite.engine.input_processor import InputProcessor
        from vllite.engine.output_processor import OutputProcessor

        self.config = config
        self.engine_info = engine_info
        self.tokenizer = tokenizer
        self.logitsproc_classes = logitsproc_classes
        self.input_processor = InputProcessor(
            config.model_config,
            engine_info,
            tokenizer,
            structured_outputs_config=getattr(config, "structured_outputs_config", None),
            lora_config=config.lora_config,
        )
        self.output_processor = OutputProcessor(
            tokenizer, log_stats=log_stats, stream_interval=config.scheduler_config.stream_interval
        )
        self.default_sampling_fields = default_sampling_fields(config.model_config)

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's generation-config defaults (vLLM's ``get_default_sampling_params``)."""
        return SamplingParams(**self.default_sampling_fields)

    def prepare(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        queue: Any = None,
        lora_request: LoRARequest | None = None,
        resumable: bool = False,
    ) -> list[EngineCoreRequest]:
        """Validates one prompt, registers its output state and returns the request(s) to send to the engine.

        Raises ``ValueError`` for a bad prompt or parameter before anything is registered. ``queue`` (async use)
        receives the request's ``RequestOutput``s. ``resumable``: the prompt is the first input chunk of a session
        (``vllite.engine.sessions``); later chunks go through :meth:`prepare_session_chunk`.
        """
        from vllite.engine.input_processor import extract_prompt_text
        from vllite.engine.parallel_sampling import ParentRequest
        from vllite.logits_processor import validate_sampling_params

        if resumable:
            self._check_session(params if params is not None else self.default_sampling_params())
        if isinstance(params, PoolingParams):
            pooling = self.input_processor.process_inputs(
                engine_request_id(request_id),
                prompt,
                params,
                arrival_time=arrival_time or time.time(),
                priority=priority,
                lora_request=lora_request,
            )
            self.output_processor.add_request(pooling, None, None, 0, queue, external_req_id=request_id)
            return [pooling]

        params = params or self.default_sampling_params()
        request = self.input_processor.process_inputs(
            engine_request_id(request_id),
            prompt,
            params,
            arrival_time=arrival_time or time.time(),
            priority=priority,
            lora_request=lora_request,
            resumable=resumable,
        )
        # Every loaded logits processor checks its per-request arguments now, not mid-batch.
        validate_sampling_params(self.logitsproc_classes, request.params)
        prompt_text = extract_prompt_text(prompt)
        if request.params.n == 1:
            self.output_processor.add_request(request, prompt_text, None, 0, queue, external_req_id=request_id)
            return [request]
        parent = ParentRequest(request, request_id)
        children = []
        for index in range(request.params.n):
            child_id, child_params = parent.get_child_info(index)
            child = msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
            self.output_processor.add_request(child, prompt_text, parent, index, queue)
            children.append(child)
        return children

    def prepare_session_chunk(
        self, engine_request_id: str, prompt: PromptType | None, params: SamplingParams | None = None
    ) -> EngineCoreRequest:
        """The next input chunk of the open session ``engine_request_id`` (its engine id), registered with its output
        state; ``prompt`` None ends the session's input. ``params`` None: the previous turn's. ``ValueError``
        (``SessionClosedError``) when the session is not open, or for a bad chunk."""
        from vllite.engine.input_processor import extract_prompt_text
        from vllite.logits_processor import validate_sampling_params

        output_processor = self.output_processor
        previous = output_processor.session_params(engine_request_id)
        if prompt is None:
            request = EngineCoreRequest(engine_request_id, [], previous, None, time.time(), continuation=True)
            output_processor.add_session_chunk(request, None)
            return request
        params = params or previous
        self._check_session(params)
        request = self.input_processor.process_inputs(
            engine_request_id, prompt, params, arrival_time=time.time(), resumable=True, continuation=True
        )
        validate_sampling_params(self.logitsproc_classes, request.params)
        output_processor.add_session_chunk(request, extract_prompt_text(prompt))
        return request

    def _check_session(self, params: SamplingParams | PoolingParams) -> None:
        from vllite.engine.sessions import check_session_params

        if isinstance(params, PoolingParams):
            raise ValueError("A session (streaming input) needs a generative model's SamplingParams.")
        if self.config.scheduler_config.async_scheduling:
            raise ValueError("Sessions (streaming input) need the engine without --async-scheduling.")
        check_session_params(params)
