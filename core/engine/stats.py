"""Engine statistics as the frontend sees them: per request and per batch of outputs (``AsyncLLM`` hands them to
its stat loggers, ``vllite.plugins.engine_proc.stat_loggers``).

Two clocks are in play and never mixed in one difference: ``arrival_time`` and ``IterationStats.iteration_timestamp``
are wall-clock (``time.time()``) readings, so time to first token and end-to-end latency are wall-clock intervals;
every other timestamp is a ``time.monotonic()`` reading taken by the engine (its events, and the time each batch
of outputs was made), so queue, prefill, decode and inter-token intervals are monotonic intervals. The meanings
follow vLLM's (``vllm/v1/metrics/stats.py``), so the figures compare.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllite import deprecated_aliases
from vllite.protocol import EngineCoreEvent, EngineCoreEventType, SpecDecodingStats


@dataclass
class RequestStateStats:
    """Per-request timing figures, kept when stats are on (``disable_log_stats=False``): ``RequestOutput.metrics``.

    ``arrival_time`` is wall-clock time and ``first_token_latency`` (seconds from arrival to the first token) a
    wall-clock interval; the other times are ``time.monotonic()`` readings: when the engine queued and first
    scheduled the request (its events), and when the first and the latest token were made (the engine's timestamp
    of their batch when known, else the frontend's reading).
    """

    arrival_time: float
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_token_latency: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_in_queue(self) -> float | None:
        """Seconds between being queued in the engine and first being scheduled."""
        if self.queued_ts is None or self.scheduled_ts is None:
            return None
        return self.scheduled_ts - self.queued_ts

    def record_events(self, events: list[EngineCoreEvent]) -> int:
        """Takes the engine's lifecycle events (a re-schedule after preemption keeps the first ``scheduled_ts``);
        returns how many of them were preemptions."""
        preempted = 0
        for event in events:
            if event.type == EngineCoreEventType.QUEUED:
                self.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and self.scheduled_ts is None:
                self.scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                preempted += 1
        self.num_preemptions += preempted
        return preempted

    def record_tokens(
        self,
        num_new_tokens: int,
        num_cached_tokens: int,
        now: float,
        prompt_len: int = 0,
        iteration: IterationStats | None = None,
    ) -> None:
        """Takes one output's token count, made at monotonic time ``now``; adds this request's share of the batch
        figures (prompt tokens and TTFT at its first token, else an inter-token latency) to ``iteration``."""
        self.num_cached_tokens = num_cached_tokens
        if not num_new_tokens:
            return
        if self.first_token_time is None:
            wall_now = iteration.iteration_timestamp if iteration is not None else time.time()
            self.first_token_latency = wall_now - self.arrival_time
            self.first_token_time = now
            if iteration is not None:
                iteration.num_prompt_tokens += prompt_len
                iteration.time_to_first_tokens_iter.append(self.first_token_latency)
        elif iteration is not None and self.last_token_time is not None:
            iteration.inter_token_latencies_iter.append(now - self.last_token_time)
        if iteration is not None:
            iteration.num_generation_tokens += num_new_tokens
        self.last_token_time = now
        self.num_generation_tokens += num_new_tokens


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request's figures, in seconds and tokens (vLLM's meanings).

    ``e2e_latency``: arrival to the batch that finished it (wall clock). ``queued_time``: queued to first
    scheduled. ``prefill_time``: first scheduled to first token. ``decode_time``: first to last token.
    ``inference_time``: first scheduled to last token (preemptions included in all of these).
    ``mean_time_per_output_token``: ``decode_time`` over the tokens after the first. An interval whose ends are
    unknown (e.g. a request that failed before its first token) is 0.0.
    """

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queued_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    mean_time_per_output_token: float


@dataclass
class IterationStats:
    """One batch of engine outputs as the frontend processed it.

    ``num_prompt_tokens`` counts the whole prompt (prefix-cache hits included) of each request that got its first
    token in this batch; ``num_generation_tokens`` every token this batch brought; ``num_preempted_reqs`` the
    preemption events it carried. ``time_to_first_tokens_iter`` has one wall-clock TTFT (from arrival) per
    request that got its first token now; ``inter_token_latencies_iter`` one interval per request that got a
    later token, since its previous one. ``finished_requests`` has one entry per request this batch finished.
    """

    iteration_timestamp: float = field(default_factory=time.time)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preempted_reqs: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    def record_finished(self, finish_reason: str, num_prompt_tokens: int, req: RequestStateStats) -> None:
        """Adds the ``FinishedRequestStats`` of a request this batch finished (its ``req`` already updated)."""
        queued = _interval(req.queued_ts, req.scheduled_ts)
        prefill = _interval(req.scheduled_ts, req.first_token_time)
        decode = _interval(req.first_token_time, req.last_token_time)
        inference = _interval(req.scheduled_ts, req.last_token_time)
        later_tokens = req.num_generation_tokens - 1
        self.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=self.iteration_timestamp - req.arrival_time,
                num_prompt_tokens=num_prompt_tokens,
                num_generation_tokens=req.num_generation_tokens,
                queued_time=queued,
                prefill_time=prefill,
                decode_time=decode,
                inference_time=inference,
                mean_time_per_output_token=decode / later_tokens if later_tokens > 0 else 0.0,
            )
        )


@dataclass
class SpecDecodingMetrics:
    """Speculative-decoding figures summed over the engine's ``SpecDecodingStats`` (vLLM's meanings).

    ``acceptance_rate``: accepted over proposed draft tokens. ``mean_acceptance_length``: tokens emitted per
    verification step of a drafted request (``1 + accepted / drafts``: the accepted drafts plus the token
    sampled after them). ``per_position_acceptance_rates[i]``: the share of drafts whose token ``i`` was
    accepted. All 0 before the first draft.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def add(self, stats: SpecDecodingStats | None) -> None:
        """Adds one ``SchedulerStats.spec_decoding_stats`` (``None``: nothing)."""
        if stats is None:
            return
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < len(stats.num_accepted_tokens_per_pos):
            per_pos.extend([0] * (len(stats.num_accepted_tokens_per_pos) - len(per_pos)))
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos[position] += count

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance_rates(self) -> list[float]:
        return [count / self.num_drafts if self.num_drafts else 0.0 for count in self.num_accepted_tokens_per_pos]


def _interval(start: float | None, end: float | None) -> float:
    return end - start if start is not None and end is not None else 0.0


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)  # the stat-logger interface, now AsyncLLM's
