"""Stop checks on a request's newest token, as ``update_from_output`` applies them token by token."""

from __future__ import annotations

from vllite.repetition import STOP_REASON, check_sequence_repetition, ends_request
from vllite.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Whether the request is finished after its latest output token; sets ``status`` (and ``stop_reason``).

    In order: the context is full (``num_tokens >= max_model_len``) → LENGTH; fewer than ``min_tokens`` outputs →
    keep going; the EOS token (unless ``ignore_eos``) → STOP with ``stop_reason`` None; a token of
    ``sampling_params.all_stop_token_ids`` → STOP with ``stop_reason`` = that token id; ``max_tokens`` outputs →
    LENGTH; the output ending in a repeated pattern (``repetition_detection``, unless its scope is the reasoning
    section only) → REPETITION with ``stop_reason`` ``"repetition_detected"``, as in vLLM. The context limit comes
    first because no further token could be computed past it.
    """
    if request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    num_output = request.num_output_tokens
    if num_output < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if last == request.eos_token_id and not params.ignore_eos:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if num_output >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    detection = params.repetition_detection
    if (
        detection is not None
        and ends_request(params)
        and check_sequence_repetition(request.output_token_ids, detection)
    ):
        request.status = RequestStatus.FINISHED_REPETITION
        request.stop_reason = STOP_REASON
        return True
    return False
