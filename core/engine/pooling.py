"""The frontend's side of pooling requests: building them and following them to their one output (the inputs of
scoring, cross-encoder pairs and cosine scores, are the pooling plugin's: ``vllite.plugins.pooling.scoring``).

A pooling request carries ``PoolingParams`` in place of ``SamplingParams``; its prompt may be a dict with
``token_type_ids`` (a cross-encoder pair), which travels as the index where the second text starts. Token tasks
(one output per position) get a fresh cache salt: a prefix-cache hit would skip positions they must return.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllite import deprecated_aliases
from vllite.engine.request_checks import check_task
from vllite.outputs import PoolingOutput, PoolingRequestOutput
from vllite.pooling_params import PoolingParams
from vllite.protocol import EngineCoreOutput, EngineCoreRequest

if TYPE_CHECKING:
    from vllite.engine.input_processor import InputProcessor
    from vllite.lora import LoRARequest


def pooling_request(
    processor: InputProcessor,
    request_id: str,
    prompt: Any,
    params: PoolingParams,
    *,
    arrival_time: float,
    priority: int,
    lora_request: LoRARequest | None,
) -> EngineCoreRequest:
    """The ``EngineCoreRequest`` of one pooling prompt; ``ValueError`` naming what is wrong."""
    task = params.task
    if task is None:
        raise ValueError("PoolingParams.task is not set; call LLM.embed/classify/score/encode, which set it.")
    check_task("", task, processor.engine_info)
    token_types = None
    if isinstance(prompt, Mapping) and "token_type_ids" in prompt:
        token_types = list(prompt["token_type_ids"])
        prompt = {key: value for key, value in prompt.items() if key != "token_type_ids"}
    token_ids, salt = processor._tokenize(prompt, params)
    processor._validate_prompt(token_ids)
    params = params.clone()
    if params.dimensions is not None:
        check_dimensions(processor.model_config.hf_text_config, params.dimensions)
    if token_types is not None:
        token_types = token_types[len(token_types) - len(token_ids) :]  # truncation keeps the last tokens
        if 1 in token_types:
            params.extra_kwargs = {**(params.extra_kwargs or {}), "token_type_start": token_types.index(1)}
    if task.startswith("token_"):
        salt = f"token-task-{uuid.uuid4().hex}"
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=None,
        eos_token_id=None,
        arrival_time=arrival_time,
        lora_request=processor._check_lora(lora_request),
        cache_salt=salt,
        priority=priority,
        pooling_params=params,
    )


def check_dimensions(hf_text_config: Any, dimensions: int) -> None:
    """``ValueError`` unless the model returns embeddings of ``dimensions`` (a Matryoshka model, or its width)."""
    hidden = getattr(hf_text_config, "hidden_size", None)
    allowed = getattr(hf_text_config, "matryoshka_dimensions", None)
    if allowed is not None:
        if dimensions not in allowed:
            raise ValueError(f"dimensions={dimensions} is not one of the model's Matryoshka sizes {list(allowed)}.")
    elif getattr(hf_text_config, "is_matryoshka", False):
        if hidden is not None and not 1 <= dimensions <= hidden:
            raise ValueError(f"dimensions must be in [1, {hidden}], got {dimensions}.")
    elif dimensions != hidden:
        raise ValueError(
            f"This model does not support `dimensions` (it is not a Matryoshka model); its embeddings have {hidden}."
        )


class PoolingRequestState:
    """Client-side state of one pooling request: waits for its one finishing output."""

    def __init__(self, request: EngineCoreRequest, external_req_id: str, queue: Any = None) -> None:
        self.request_id = request.request_id
        self.external_req_id = external_req_id
        self.prompt_token_ids = list(request.prompt_token_ids or [])
        self.prompt_len = len(self.prompt_token_ids)
        self.queue = queue
        self.parent_req = None
        self.stats = None

    def make_request_output(
        self, new_token_ids: list[int], finish_reason: Any, stop_reason: Any
    ) -> PoolingRequestOutput:
        """The final output of a request that ended without a result (aborted)."""
        error = f"the request finished ({finish_reason}) without a result"
        return PoolingRequestOutput(self.external_req_id, PoolingOutput(None), self.prompt_token_ids, True, 0, error)

    def make_output(self, output: EngineCoreOutput) -> PoolingRequestOutput | None:
        """The request's result once it finished (``error`` set when it failed), else ``None``."""
        if output.finish_reason is None:
            return None
        data = output.pooling_output
        error = output.error or (None if data is not None else f"finished ({output.finish_reason}) without a result")
        return PoolingRequestOutput(
            self.external_req_id, PoolingOutput(data), self.prompt_token_ids, True, output.num_cached_tokens, error
        )


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)  # the scoring helpers, now the pooling plugin's
