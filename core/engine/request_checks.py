"""Engine-side checks of every request field the engine acts on, against the limits it settled on.

The frontend validates requests too, but the engine does not trust a frame: a request whose token ids, lengths,
logprobs counts, logit-bias keys or allowed token ids are out of range would otherwise crash a step (an index
out of the vocabulary) for every request in the batch. ``check_request`` raises ``ValueError`` naming the field;
``EngineCore.add_request`` turns that into an ERROR finish output for that request only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

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
