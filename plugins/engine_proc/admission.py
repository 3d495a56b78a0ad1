"""Admission control, as vLLM's ``AsyncLLM.check_admission``: ``--max-num-queued-reqs`` and ``--max-num-queued-tokens``.

The frontend refuses a request before it reaches the engine, with no round trip, from what its own
``OutputProcessor`` knows: every request it has submitted that has not finished (waiting or running in the engine),
and which of them have not produced their first output yet (still waiting or prefilling) with their prompt lengths.

- ``max_num_queued_reqs``: refused when the unfinished requests plus the new one's ``n`` exceed it (a request with
  ``n > 1`` takes ``n`` slots, its child requests) — :class:`QueueOverflowError`.
- ``max_num_queued_tokens``: refused when the prompt tokens of the requests without a first output reach it (the
  backlog already there, not counting the new request, as vLLM) — :class:`MaxQueuedTokensError`.

The request limit is checked first; ``None`` is no limit, 0 refuses everything. Both errors are a 503, which the
server answers with vLLM's body. :func:`admit` also tells each stat logger that has
``record_admission_rejection(reason)`` (the server's Prometheus logger: ``admission_rejections_total{reason}``),
once per refused request. The counts are this frontend's: with several API-server processes each has its own, and
with data parallel they span every engine it routes to (vLLM's scope too).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllite.exceptions import VlliteError


class AdmissionRejectedError(VlliteError):
    """A request refused before it reaches the engine because the server has too much work in flight (HTTP 503, so
    that a load balancer retries elsewhere; vLLM's ``GracefulHTTPError``): ``reason`` names the limit, as the
    ``reason`` label of ``admission_rejections_total``; the message is vLLM's."""

    reason = ""
    message = ""

    def __init__(self) -> None:
        super().__init__(self.message)


class QueueOverflowError(AdmissionRejectedError):
    """``--max-num-queued-reqs``: the requests in flight (waiting or running) plus the new one's ``n`` exceed it."""

    reason = "max_num_queued_reqs"
    message = (
        "The engine is currently busy and cannot accept new requests. Please try again later or on a different "
        "instance."
    )


class MaxQueuedTokensError(AdmissionRejectedError):
    """``--max-num-queued-tokens``: the prompt tokens of the requests still waiting for their first token reach it."""

    reason = "max_num_queued_tokens"
    message = (
        "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."
    )


logger = logging.getLogger(__name__)


def num_queued_tokens(output_processor: Any) -> int:
    """The prompt tokens of the requests that have not produced their first output yet (a pooling request's one
    output finishes it, so it counts until then)."""
    states = output_processor.request_states.values()
    return sum(state.prompt_len for state in states if getattr(state, "is_prefilling", True))


def check_admission(scheduler_config: Any, output_processor: Any, n: int = 1) -> None:
    """Raises :class:`QueueOverflowError` or :class:`MaxQueuedTokensError` when a request of ``n`` samples must be
    refused under ``scheduler_config``'s ``max_num_queued_reqs`` / ``max_num_queued_tokens``; returns otherwise."""
    max_reqs = scheduler_config.max_num_queued_reqs
    if max_reqs is not None and output_processor.get_num_unfinished_requests() + n > max_reqs:
        raise QueueOverflowError()
    max_tokens = scheduler_config.max_num_queued_tokens
    if max_tokens is not None and num_queued_tokens(output_processor) >= max_tokens:
        raise MaxQueuedTokensError()


def admit(scheduler_config: Any, output_processor: Any, stat_loggers: Sequence[Any] = (), n: int = 1) -> None:
    """:func:`check_admission`; a refusal is logged (DEBUG) and handed to every stat logger that has
    ``record_admission_rejection`` before it is raised."""
    try:
        check_admission(scheduler_config, output_processor, n)
    except AdmissionRejectedError as exc:
        logger.debug("Request refused at admission (%s): %s", exc.reason, exc)
        for stat_logger in stat_loggers:
            record = getattr(stat_logger, "record_admission_rejection", None)
            if record is None:
                continue
            try:
                record(exc.reason)
            except Exception:  # a broken logger must not turn the 503 into a 500
                logger.exception("Stat logger %r failed to record an admission rejection", stat_logger)
        raise
