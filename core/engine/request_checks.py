"""Engine-side checks of every request field the engine acts on, against the limits it settled on.

The frontend validates requests too, but the engine does not trust a frame: a request whose token ids, lengths,
logprobs counts, logit-bias keys or allowed token ids are out of range would otherwise crash a step (an index
out of the vocabulary) for every request in the batch. ``check_request`` raises ``ValueError`` naming the field;
``EngineCore.add_request`` turns that into an ERROR finish output for that request only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllite.protocol import EngineInfo
    from vllite.request import Request
    from vllite.sampling_params import SamplingParams


def check_request(request: Request, info: EngineInfo, *, session_chunk: bool = False) -> None:
    """Raises ``ValueError`` (the request id, the field and the allowed range) if ``request`` is unsafe to run.
    ``session_chunk``: a later input chunk of a session, which may be empty (the turn only generates)."""
    prefix = f"Request {request.request_id!r}:"
    prompt = request.prompt_token_ids
    if not prompt and not session_chunk:
        raise ValueError(f"{prefix} the prompt is empty.")
    if request.resumable and (request.pooling_params is not None or request.use_structured_output):
        raise ValueError(f"{prefix} a session (resumable request) cannot use pooling or structured outputs.")
    if len(prompt) > info.max_model_len:
        raise ValueError(f"{prefix} the prompt has {len(prompt)} tokens, more than max_model_len={info.max_model_len}.")
    _check_ids(prefix, "prompt_token_ids", prompt, info.vocab_size)
    check_task(prefix, request.pooling_params.task if request.pooling_params is not None else "generate", info)
    if request.pooling_params is None:
        _check_params(prefix, request.sampling_params, info.vocab_size)
    if request.prompt_embeds is not None:
        check_prompt_embeds(prefix, request.prompt_embeds, info)
        if len(request.prompt_embeds) != len(prompt):
            raise ValueError(f"{prefix} prompt_embeds has {len(request.prompt_embeds)} rows for {len(prompt)} tokens.")
        check_embeds_request(prefix, request.sampling_params, request.pooling_params is not None, request.resumable)


def check_prompt_embeds(prefix: str, embeds: Any, info: EngineInfo) -> None:
    """Raises ``ValueError`` naming the problem unless ``embeds`` is a usable ``prompt_embeds`` tensor for this
    engine: prompt embeds enabled, a dense float tensor of shape ``[num_tokens, hidden_size]``, not empty, at most
    ``max_model_len`` rows."""
    if not info.enable_prompt_embeds:
        raise ValueError(
            f"{prefix} prompt_embeds given, but prompt embeds are not enabled: start the engine with "
            "enable_prompt_embeds=True (--enable-prompt-embeds)."
        )
    import torch

    if not isinstance(embeds, torch.Tensor) or embeds.layout != torch.strided:
        raise ValueError(f"{prefix} prompt_embeds must be a dense torch.Tensor, got {type(embeds).__name__}.")
    if embeds.ndim != 2:
        raise ValueError(
            f"{prefix} prompt_embeds must be 2-D, [num_tokens, hidden_size]; got shape {tuple(embeds.shape)}."
        )
    if not embeds.is_floating_point():
        raise ValueError(f"{prefix} prompt_embeds must have a floating-point dtype, got {embeds.dtype}.")
    if info.hidden_size and embeds.shape[1] != info.hidden_size:
        raise ValueError(
            f"{prefix} prompt_embeds hidden size {embeds.shape[1]} does not match the model's hidden size "
            f"{info.hidden_size}."
        )
    if embeds.shape[0] == 0:
        raise ValueError(f"{prefix} prompt_embeds is empty (0 rows); give at least one embedding row.")
    if embeds.shape[0] > info.max_model_len:
        raise ValueError(
            f"{prefix} prompt_embeds has {embeds.shape[0]} rows, more than max_model_len={info.max_model_len}."
        )


def check_embeds_request(prefix: str, params: SamplingParams | None, pooling: bool, resumable: bool) -> None:
    """Raises ``ValueError`` for what an embeds prompt cannot do: pooling, sessions, prompt logprobs (there are no
    prompt token ids to score)."""
    if pooling or resumable:
        raise ValueError(f"{prefix} prompt_embeds are supported for generation requests only (not pooling, sessions).")
    if params is not None and params.prompt_logprobs is not None:
        raise ValueError(f"{prefix} prompt_logprobs cannot be computed for a prompt_embeds prompt (no token ids).")


def check_task(prefix: str, task: str | None, info: EngineInfo) -> None:
    """Raises ``ValueError`` naming the model's tasks when it does not support ``task``."""
    if task not in info.supported_tasks:
        asked = "generation" if task == "generate" else f"the pooling task {task!r}"
        raise ValueError(
            f"{prefix} this model does not support {asked}; it supports: {', '.join(info.supported_tasks)}."
        )


def _check_params(prefix: str, params: SamplingParams, vocab_size: int) -> None:
    if params.n != 1:
        raise ValueError(
            f"{prefix} SamplingParams.n must be 1 at the engine (the frontend fans n out), got {params.n}."
        )
    if params.max_tokens is not None and params.max_tokens < 1:
        raise ValueError(f"{prefix} SamplingParams.max_tokens must be >= 1, got {params.max_tokens}.")
    if params.min_tokens < 0 or (params.max_tokens is not None and params.min_tokens > params.max_tokens):
        raise ValueError(f"{prefix} SamplingParams.min_tokens must be in [0, max_tokens], got {params.min_tokens}.")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not -1 <= value <= vocab_size:
            raise ValueError(
                f"{prefix} SamplingParams.{name} must be in [0, {vocab_size}] (the vocabulary) or -1, got {value}."
            )
    if params.logit_bias:
        _check_ids(prefix, "logit_bias keys", params.logit_bias, vocab_size)
    if params.allowed_token_ids is not None:
        if not params.allowed_token_ids:
            raise ValueError(f"{prefix} SamplingParams.allowed_token_ids must not be empty.")
        _check_ids(prefix, "allowed_token_ids", params.allowed_token_ids, vocab_size)


def _check_ids(prefix: str, field: str, token_ids: Iterable[int], vocab_size: int) -> None:
    for token_id in token_ids:
        if isinstance(token_id, bool) or not hasattr(token_id, "__index__") or not 0 <= token_id < vocab_size:
            raise ValueError(f"{prefix} {field} holds {token_id!r}, not a token id in [0, {vocab_size}).")
