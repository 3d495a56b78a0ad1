"""Stat loggers: what ``AsyncLLM(stat_loggers=[...])`` feeds the engine's figures to, once per batch of outputs.

``StatLogger`` is the interface (the server's Prometheus exporter is one); a factory builds one from the
``EngineInfo`` once the engine has started. ``SpecDecodingStatLogger`` sums each engine's speculative-decoding
figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeAlias, runtime_checkable

from vllite.engine.stats import IterationStats, SpecDecodingMetrics
from vllite.protocol import EngineInfo, SchedulerStats


class SpecDecodingStatLogger:
    """A ``StatLogger`` that sums each engine's speculative-decoding figures (``metrics[engine_index]``), e.g.
    ``AsyncLLM(config, stat_loggers=[SpecDecodingStatLogger()])`` with stats on (``disable_log_stats=False``)."""

    def __init__(self) -> None:
        self.metrics: dict[int, SpecDecodingMetrics] = {}

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        """Adds the batch's ``spec_decoding_stats`` (if any) to engine ``engine_index``'s sums."""
        if scheduler_stats is not None and scheduler_stats.spec_decoding_stats is not None:
            self.metrics.setdefault(engine_index, SpecDecodingMetrics()).add(scheduler_stats.spec_decoding_stats)


@runtime_checkable
class StatLogger(Protocol):
    """Receives the engine's figures once per batch of outputs (``AsyncLLM(stat_loggers=[...])``).

    ``scheduler_stats`` is the engine's latest ``SchedulerStats`` when the batch carried one (its prefix-cache
    and preemption counts are deltas since the previous one), ``iteration_stats`` the batch's figures;
    ``engine_index`` names the engine that sent them. Called on the event loop: it must be quick and not block.
    A logger may also have ``record_admission_rejection(reason)``: ``AsyncLLM`` calls it for each request its
    admission limits refuse (``vllite.plugins.engine_proc.admission``).
    """

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None: ...


#: Builds a ``StatLogger`` once the engine has started and reported its ``EngineInfo`` (limits such as
#: ``max_model_len`` that a logger may need, e.g. for histogram buckets).
StatLoggerFactory: TypeAlias = Callable[[EngineInfo], StatLogger]


def build_stat_loggers(
    loggers: Iterable[StatLogger | StatLoggerFactory], engine_info: EngineInfo
) -> tuple[StatLogger, ...]:
    """The loggers, each factory (a class too, even one with ``record``) called with ``engine_info``."""
    built: list[StatLogger] = []
    for item in loggers:
        if isinstance(item, StatLogger) and not isinstance(item, type):
            built.append(item)
        else:
            built.append(item(engine_info))
    return tuple(built)
