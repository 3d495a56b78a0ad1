"""Repetition detection: vLLM's ``SamplingParams.repetition_detection`` and the check that ends a looping request.

A request with ``repetition_detection=RepetitionDetectionParams(max_pattern_size=P, min_count=C)`` finishes with
``FinishReason.REPETITION`` (``finish_reason: "repetition"`` over HTTP, ``stop_reason: "repetition_detected"``) as
soon as its output ends in ``C`` back-to-back copies of a pattern of ``min_pattern_size``..``P`` tokens: the
scheduler's stop check runs :func:`check_sequence_repetition` after each output token, as vLLM's does.

With ``extra_args={"repetition_detection_scope": "reasoning"}`` the request is not ended: the builtin
``repetition_detection`` logits processor (``vllite.builtin_logitsprocs.repetition_detection``) watches only the
reasoning section and, on a loop there, forces the end-of-reasoning marker so that the model goes on to answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

#: ``extra_args`` key choosing what a detected repetition ends: ``"request"`` (the default) or ``"reasoning"``.
SCOPE_KEY = "repetition_detection_scope"
SCOPES = ("request", "reasoning")
#: ``stop_reason`` of a request ended by repetition detection (vLLM's value).
STOP_REASON = "repetition_detected"


class RepetitionDetectionParams(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``RepetitionDetectionParams``: end the output once it repeats an N-gram back to back.

    ``max_pattern_size``: the longest pattern checked (0 disables detection). ``min_pattern_size``: the shortest
    (0 means 1); at most ``max_pattern_size``. ``min_count``: how many consecutive copies trigger it, >= 2 when
    detection is on. Example: ``max_pattern_size=4, min_count=3`` ends ``... a b c a b c a b c``.
    """

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SamplingParams.repetition_detection.{name} must be an integer >= 0, got {value!r}.")
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError(
                "SamplingParams.repetition_detection.min_pattern_size must be <= max_pattern_size "
                f"({self.max_pattern_size}), got {self.min_pattern_size}; set both to 0 to disable detection."
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(
                f"SamplingParams.repetition_detection.min_count must be >= 2 when max_pattern_size > 0, got "
                f"{self.min_count}; set max_pattern_size to 0 to disable detection."
            )

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0


def as_repetition_detection(value: Any) -> RepetitionDetectionParams | None:
    """``value`` as ``RepetitionDetectionParams``: one already, a dict of its fields (as JSON gives it), or None;
    ``ValueError`` naming the field otherwise."""
    if value is None or isinstance(value, RepetitionDetectionParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(
            "SamplingParams.repetition_detection must be None, a RepetitionDetectionParams or a dict with "
            f"max_pattern_size, min_pattern_size and min_count, got {value!r}."
        )
    unknown = sorted(set(value) - set(RepetitionDetectionParams.__struct_fields__))
    if unknown:
        raise ValueError(
            f"SamplingParams.repetition_detection has unknown fields {unknown}; it takes max_pattern_size, "
            "min_pattern_size and min_count."
        )
    return RepetitionDetectionParams(**value)


def check_sequence_repetition(token_ids: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """Whether ``token_ids`` ends in ``params.min_count`` consecutive copies of one pattern whose length is in
    ``[min_pattern_size, max_pattern_size]`` (vLLM's check; the shortest patterns are tried first)."""
    min_count = params.min_count
    if params.max_pattern_size <= 0 or min_count < 2:
        return False
    num_tokens = len(token_ids)
    for size in range(max(1, params.min_pattern_size), params.max_pattern_size + 1):
        if size * min_count > num_tokens:
            return False
        if _ends_in_copies(token_ids, size, min_count):
            return True
    return False


def _ends_in_copies(token_ids: Sequence[int], size: int, count: int) -> bool:
    tail = token_ids[-size:]
    end = len(token_ids) - size
    for _ in range(count - 1):
        if token_ids[end - size : end] != tail:
            return False
        end -= size
    return True


def ends_request(params: Any) -> bool:
    """Whether the request's ``repetition_detection`` ends the request (the default scope) rather than only its
    reasoning section."""
    extra = params.extra_args
    return not extra or extra.get(SCOPE_KEY, "request") != "reasoning"
