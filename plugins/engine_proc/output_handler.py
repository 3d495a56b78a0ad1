"""``AsyncLLM``'s output handler: the background task that pulls engine outputs, routes them into the per-request
output queues and hands each batch's stats to the stat loggers; and the helpers it and ``AsyncLLM`` share."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from vllite.engine.stats import IterationStats
from vllite.exceptions import EngineClientClosedError, EngineDeadError
from vllite.plugins.engine_proc.stat_loggers import StatLogger
from vllite.protocol import EngineCoreOutputs

logger = logging.getLogger(__name__)

# Outputs processed per slice before yielding to the event loop (keeps the loop responsive under big batches).
OUTPUT_CHUNK_SIZE = 128


def call_in_loop(loop: asyncio.AbstractEventLoop | None, fn: Any, *args: Any) -> None:
    """Runs ``fn(*args)`` on ``loop``'s thread: now when called there (or when the loop is gone), else soon."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is None or loop is running or loop.is_closed():
        fn(*args)
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # closed meanwhile: nobody can be waiting in it
        fn(*args)


async def output_handler(engine_core: Any, output_processor: Any, stat_loggers: Sequence[StatLogger] = ()) -> None:
    """Pulls engine outputs and routes them to the per-request collectors until the engine stops; with
    ``stat_loggers``, hands each batch's stats to every one of them (``_record_stats``).

    A failure in one request's output processing ends that request only (``OutputProcessor`` turns it into a
    ``RequestProcessingError`` in its stream and lists it for abort here). When the client itself fails, every
    open stream gets the error: ``EngineDeadError`` (the engine died), ``EngineClientClosedError`` (shut down), or
    the unexpected exception itself (then the requests are aborted in the engine, which may still be healthy).
    """
    failed_loggers: set[int] = set()
    try:
        while True:
            outputs = await engine_core.get_output_async()
            if not isinstance(outputs, EngineCoreOutputs):  # a data-parallel engine died: its requests fail
                _fail_requests(output_processor, outputs.request_ids, outputs.error)
                continue
            batch = outputs.outputs
            iteration_stats = IterationStats() if stat_loggers else None
            for start in range(0, len(batch), OUTPUT_CHUNK_SIZE):
                if start:
                    await asyncio.sleep(0)
                chunk = batch[start : start + OUTPUT_CHUNK_SIZE]
                processed = output_processor.process_outputs(chunk, outputs.timestamp, iteration_stats)
                if processed.reqs_to_abort:
                    engine_core.abort_requests(processed.reqs_to_abort)
            if stat_loggers:
                _record_stats(stat_loggers, outputs, iteration_stats, failed_loggers)
    except asyncio.CancelledError:
        raise
    except (EngineDeadError, EngineClientClosedError) as exc:
        output_processor.fail_all(exc)
    except Exception as exc:
        logger.exception("AsyncLLM output handler failed")
        request_ids = output_processor.fail_all(exc)
        with contextlib.suppress(EngineDeadError, EngineClientClosedError):
            engine_core.abort_requests(request_ids)


def _fail_requests(output_processor: Any, request_ids: list[str], error: Exception) -> None:
    """Ends the given requests (internal ids) with ``error``: their streams raise it; the rest go on."""
    for request_id in request_ids:
        state = output_processor.request_states.get(request_id)
        if state is not None and state.queue is not None:
            state.queue.put(error)
    output_processor.abort_requests(request_ids, internal=True)


def record_aborted(stat_loggers: Sequence[StatLogger], iteration_stats: IterationStats) -> None:
    """Hands the stats of requests the client aborted (no engine output reports them) to every logger; a logger
    that raises is logged and skipped, and the abort goes on."""
    for stat_logger in stat_loggers:
        try:
            stat_logger.record(None, iteration_stats)
        except Exception:
            logger.exception("Stat logger %r failed on aborted requests; the abort goes on", stat_logger)


def _record_stats(
    stat_loggers: Sequence[StatLogger],
    outputs: EngineCoreOutputs,
    iteration_stats: IterationStats | None,
    failed_loggers: set[int],
) -> None:
    """Hands one batch's stats to every logger. A logger that raises is skipped for this batch; its first failure
    is logged with the traceback, later ones only at debug level."""
    for stat_logger in stat_loggers:
        try:
            stat_logger.record(outputs.scheduler_stats, iteration_stats, outputs.engine_index)
        except Exception:
            if id(stat_logger) in failed_loggers:
                logger.debug("Stat logger %r failed again", stat_logger, exc_info=True)
            else:
                failed_loggers.add(id(stat_logger))
                logger.exception("Stat logger %r failed; it is skipped for this batch, the engine goes on", stat_logger)
