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
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllite import deprecated_aliases
from vllite.protocol import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest, SpecDecodingStats

#: The W3C trace headers (``traceparent``, ``tracestate``) of the HTTP request being served, set by the server's
#: trace-context middleware (``vllite.plugins.openai_server.observability.tracing``): a request added while it is set,
#: without trace headers of its own, is traced as a child of the caller's span.
current_trace_headers: ContextVar[dict[str, str] | None] = ContextVar("vllite_trace_headers", default=None)


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
    # Some step's logits of this request had NaNs (EngineCoreOutput.num_nans_in_logits, with
    # $VLLITE_COMPUTE_NANS_IN_LOGITS): it counts as corrupted when it finishes.
    is_corrupted: bool = False
    # What the request asked for (``for_request``): the finished-request metrics and the tracing span read them.
    request_id: str = ""
    params: RequestParamStats | None = None
    trace_headers: dict[str, str] | None = None
    siblings: SiblingStats | None = None  # shared by the ``n > 1`` children of one request

    def __post_init__(self) -> None:
        if self.trace_headers is None:  # made while serving an HTTP request: its trace context
            self.trace_headers = current_trace_headers.get()

    @classmethod
    def for_request(
        cls, request: EngineCoreRequest, external_req_id: str | None = None, parent_req: Any = None
    ) -> RequestStateStats:
        """The stats of a new request: its arrival time, its id (the caller's, ``external_req_id``), its sampling
        parameters and trace headers (its own, else those of the HTTP request being served). ``parent_req`` (a
        ``ParentRequest``) groups the children of an ``n > 1`` request, so that ``n`` and the longest child are
        observed once, when the last child finishes."""
        siblings = None
        if parent_req is not None:
            siblings = _SIBLINGS.get(parent_req)
            if siblings is None:
                siblings = _SIBLINGS[parent_req] = SiblingStats(remaining=int(parent_req.n))
        return cls(
            arrival_time=request.arrival_time,
            request_id=external_req_id or request.request_id,
            params=RequestParamStats.of(request.params, parent_req),
            trace_headers=request.trace_headers,
            siblings=siblings,
        )

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
                iteration.prompt_token_stats.add(num_cached_tokens, 0, prompt_len)
                iteration.time_to_first_tokens_iter.append(self.first_token_latency)
        elif iteration is not None and self.last_token_time is not None:
            iteration.inter_token_latencies_iter.append(now - self.last_token_time)
        if iteration is not None:
            iteration.num_generation_tokens += num_new_tokens
        self.last_token_time = now
        self.num_generation_tokens += num_new_tokens


@dataclass(frozen=True)
class RequestParamStats:
    """The sampling parameters the metrics and traces report (``n`` is the original request's, before its children
    were split off)."""

    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None

    @classmethod
    def of(cls, params: Any, parent_req: Any = None) -> RequestParamStats:
        """The figures of a ``SamplingParams`` (a pooling request's params have none of them)."""
        n = int(parent_req.n) if parent_req is not None else int(getattr(params, "n", 1) or 1)
        return cls(
            n=n,
            max_tokens=getattr(params, "max_tokens", None),
            temperature=getattr(params, "temperature", None),
            top_p=getattr(params, "top_p", None),
        )


@dataclass
class SiblingStats:
    """The children of one ``n > 1`` request still running, and the most tokens one of them generated so far."""

    remaining: int
    max_num_generation_tokens: int = 0


# One SiblingStats per ParentRequest, dropped with it.
_SIBLINGS: weakref.WeakKeyDictionary[Any, SiblingStats] = weakref.WeakKeyDictionary()


@dataclass
class PromptTokenStats:
    """Where one batch's prompt tokens came from (vLLM's ``prompt_tokens_by_source`` sources).

    ``computed``: prefilled here; ``local_cache_hit``: found in the prefix cache; ``external_kv_transfer``: loaded
    by a KV connector; ``cached_tokens``: skipped at prefill (cache hits and loads); ``recomputed_tokens``: cached
    tokens computed anyway (a prompt cached whole still computes its last token, which yields the logits).
    ``computed + local_cache_hit + external_kv_transfer - recomputed_tokens == total``.
    """

    ALL_SOURCES: ClassVar[tuple[str, ...]] = ("local_compute", "local_cache_hit", "external_kv_transfer")

    computed: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    total: int = 0

    def add(self, num_cached_tokens: int, num_external_tokens: int, prompt_len: int) -> None:
        """Adds one request's prefill: ``num_cached_tokens`` of its ``prompt_len`` were skipped, of which
        ``num_external_tokens`` a KV connector loaded."""
        num_cached_tokens = max(0, min(num_cached_tokens, prompt_len))
        recomputed = 1 if num_cached_tokens + 1 == prompt_len else 0
        self.computed += prompt_len - num_cached_tokens
        self.external_kv_transfer += num_external_tokens
        self.local_cache_hit += num_cached_tokens + recomputed - num_external_tokens
        self.cached_tokens += num_cached_tokens
        self.recomputed_tokens += recomputed
        self.total += prompt_len

    def get_by_source(self, source: str) -> int:
        """The tokens of one of ``ALL_SOURCES``; ``ValueError`` for another name."""
        if source == "local_compute":
            return self.computed
        if source == "local_cache_hit":
            return self.local_cache_hit
        if source == "external_kv_transfer":
            return self.external_kv_transfer
        raise ValueError(f"Unknown prompt token source {source!r}; expected one of {self.ALL_SOURCES}.")


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request's figures, in seconds and tokens (vLLM's meanings).

    ``e2e_latency``: arrival to the batch that finished it (wall clock). ``queued_time``: queued to first
    scheduled. ``prefill_time``: first scheduled to first token. ``decode_time``: first to last token.
    ``inference_time``: first scheduled to last token (preemptions included in all of these).
    ``mean_time_per_output_token``: ``decode_time`` over the tokens after the first. An interval whose ends are
    unknown (e.g. a request that failed before its first token) is 0.0.

    The rest identify the request for tracing: its id, wall-clock ``arrival_time``, ``first_token_latency``
    (seconds from arrival to its first token), ``num_cached_tokens`` (prompt tokens it did not prefill), its
    sampling ``params`` and the ``trace_headers`` it arrived with.
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
    request_id: str = ""
    arrival_time: float = 0.0
    first_token_latency: float = 0.0
    num_cached_tokens: int = 0
    params: RequestParamStats | None = None
    trace_headers: dict[str, str] | None = None
    num_preemptions: int = 0  # times the engine preempted it (vLLM's ``request_num_preemptions``)

    @property
    def max_tokens_param(self) -> int | None:
        """The request's ``max_tokens`` (``None``: not known, or not set)."""
        return self.params.max_tokens if self.params is not None else None

    @property
    def num_prefill_kv_computed_tokens(self) -> int:
        """Prompt tokens whose KV was computed at prefill (the prompt less its prefix-cache hits and loads)."""
        return max(0, self.num_prompt_tokens - self.num_cached_tokens)


@dataclass
class IterationStats:
    """One batch of engine outputs as the frontend processed it.

    ``num_prompt_tokens`` counts the whole prompt (prefix-cache hits included) of each request that got its first
    token in this batch; ``num_generation_tokens`` every token this batch brought; ``num_preempted_reqs`` the
    preemption events it carried; ``num_corrupted_reqs`` the finished requests that had NaN logits.
    ``time_to_first_tokens_iter`` has one wall-clock TTFT (from arrival) per
    request that got its first token now; ``inter_token_latencies_iter`` one interval per request that got a
    later token, since its previous one. ``finished_requests`` has one entry per request this batch finished.
    ``prompt_token_stats`` splits the prompt tokens by source. ``n_params_iter`` and
    ``max_num_generation_tokens_iter`` have one entry per original request finished (all its ``n`` children
    done): its ``n``, and the most tokens one of its sequences generated.
    """

    iteration_timestamp: float = field(default_factory=time.time)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preempted_reqs: int = 0
    num_corrupted_reqs: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    prompt_token_stats: PromptTokenStats = field(default_factory=PromptTokenStats)
    n_params_iter: list[int] = field(default_factory=list)
    max_num_generation_tokens_iter: list[int] = field(default_factory=list)

    def record_finished(self, finish_reason: str, num_prompt_tokens: int, req: RequestStateStats) -> None:
        """Adds the ``FinishedRequestStats`` of a request this batch finished (its ``req`` already updated)."""
        queued = _interval(req.queued_ts, req.scheduled_ts)
        prefill = _interval(req.scheduled_ts, req.first_token_time)
        decode = _interval(req.first_token_time, req.last_token_time)
        inference = _interval(req.scheduled_ts, req.last_token_time)
        later_tokens = req.num_generation_tokens - 1
        self.num_corrupted_reqs += req.is_corrupted
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
                request_id=req.request_id,
                arrival_time=req.arrival_time,
                first_token_latency=req.first_token_latency or 0.0,
                num_cached_tokens=req.num_cached_tokens,
                params=req.params,
                trace_headers=req.trace_headers,
                num_preemptions=req.num_preemptions,
            )
        )
        self._observe_request_params(req)

    def _observe_request_params(self, req: RequestStateStats) -> None:
        """``n`` and the longest sequence of the original request, once it is done (its last child, if ``n > 1``)."""
        num_tokens = req.num_generation_tokens
        siblings = req.siblings
        if siblings is not None:
            siblings.remaining -= 1
            siblings.max_num_generation_tokens = max(siblings.max_num_generation_tokens, num_tokens)
            if siblings.remaining > 0:
                return
            num_tokens = siblings.max_num_generation_tokens
        self.n_params_iter.append(req.params.n if req.params is not None else 1)
        self.max_num_generation_tokens_iter.append(num_tokens)


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
