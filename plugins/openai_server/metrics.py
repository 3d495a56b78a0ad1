"""Prometheus metrics for ``GET /metrics``: vLLM's metric names with the ``vllite:`` prefix, fed as a ``StatLogger``.

Names, types, labels (``model_name``, ``engine``; ``finished_reason`` on ``request_success``) and histogram buckets
are vLLM's (``vllm/v1/metrics/loggers.py``), so a vLLM dashboard works after swapping ``vllm:`` for ``vllite:``.
Counters show with a ``_total`` suffix in the exposition, as vLLM's do. Each logger has its own
``CollectorRegistry`` (several servers may share one process)::

    engine = AsyncLLM(config=config, stat_loggers=[lambda info: PrometheusStatLogger("my-model", info)])
    metrics = engine.stat_loggers[0]
    body, content_type = metrics.render()
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllite.engine.stats import IterationStats
from vllite.protocol import EngineInfo, FinishReason, SchedulerStats, SpecDecodingStats

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


class PrometheusStatLogger:
    """A ``StatLogger`` that keeps vLLM's Prometheus metrics (prefix ``vllite:``) in its own registry.

    Gauges hold the latest ``SchedulerStats`` (running, waiting, KV-cache usage); the scheduler's prefix-cache,
    preemption and speculative-decoding figures (``spec_decode_num_drafts``, ``..._num_draft_tokens``,
    ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos`` with a ``position`` label), which are deltas
    since its previous stats, are added to counters; token counters and
    the TTFT / inter-token histograms come from each ``IterationStats``, the per-request histograms and
    ``request_success`` from its finished requests. ``render()`` is the ``/metrics`` response.
    """

    def __init__(self, model_name: str, engine_info: EngineInfo, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labelnames = ["model_name", "engine"]
        token_buckets = buckets_1_2_5(int(engine_info.max_model_len))

        self._gauge_running = self._gauge("num_requests_running", "Number of requests in model execution batches.")
        self._gauge_waiting = self._gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self._gauge_kv_usage = self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._prefix_queries = self._counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self._prefix_hits = self._counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self._preemptions = self._counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self._prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = self._counter("generation_tokens", "Number of generation tokens processed.")
        self._request_success = Counter(
            "vllite:request_success",
            "Count of successfully processed requests.",
            [*self._labelnames, "finished_reason"],
            registry=self.registry,
        )
        self._ttft = self._histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self._itl = self._histogram(
            "inter_token_latency_seconds", "Inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS
        )
        self._tpot = self._histogram(
            "request_time_per_output_token_seconds", "Time per output token of each request.", TOKEN_LATENCY_BUCKETS
        )
        self._e2e = self._histogram(
            "e2e_request_latency_seconds", "End-to-end request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self._queue_time = self._histogram(
            "request_queue_time_seconds", "Time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS
        )
        self._prefill_time = self._histogram(
            "request_prefill_time_seconds", "Time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS
        )
        self._decode_time = self._histogram(
            "request_decode_time_seconds", "Time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS
        )
        self._inference_time = self._histogram(
            "request_inference_time_seconds", "Time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS
        )
        self._request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self._request_generation_tokens = self._histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self._spec_drafts = self._counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self._spec_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self._spec_accepted_tokens = self._counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._spec_accepted_per_pos = Counter(
            "vllite:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*self._labelnames, "position"],
            registry=self.registry,
        )
        self._engines: dict[int, _EngineMetrics] = {}
        self._engine(0)  # engine 0's series show (at zero) before the first request
        self._lora_info: Gauge | None = None  # vllite:lora_requests_info, made by the first record_lora_states()
        self._lora_labels: tuple[str, str, str] | None = None

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        """Updates the metrics of engine ``engine_index`` from one batch's stats."""
        m = self._engine(engine_index)
        if scheduler_stats is not None:
            m.running.set(scheduler_stats.num_running_reqs)
            m.waiting.set(scheduler_stats.num_waiting_reqs)
            m.kv_usage.set(scheduler_stats.kv_cache_usage)
            m.prefix_queries.inc(scheduler_stats.prefix_cache_queries)
            m.prefix_hits.inc(scheduler_stats.prefix_cache_hits)
            m.preemptions.inc(scheduler_stats.num_preemptions)
            if scheduler_stats.spec_decoding_stats is not None:
                m.record_spec_decoding(scheduler_stats.spec_decoding_stats)
        if iteration_stats is None:
            return
        m.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        m.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens_iter:
            m.ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            m.itl.observe(itl)
        for finished in iteration_stats.finished_requests:
            m.success(finished.finish_reason).inc()
            m.e2e.observe(finished.e2e_latency)
            m.queue_time.observe(finished.queued_time)
            m.prefill_time.observe(finished.prefill_time)
            m.decode_time.observe(finished.decode_time)
            m.inference_time.observe(finished.inference_time)
            m.tpot.observe(finished.mean_time_per_output_token)
            m.prompt_tokens_hist.observe(finished.num_prompt_tokens)
            m.generation_tokens_hist.observe(finished.num_generation_tokens)

    def record_lora_states(self, max_loras: int, waiting: list[str], running: list[str]) -> None:
        """Sets vLLM's ``lora_requests_info`` gauge: labels ``max_lora``, ``waiting_lora_adapters`` and
        ``running_lora_adapters`` (the adapters of the requests waiting and running, comma-joined), value the
        current time. Only the latest label set is kept (vLLM keeps every one seen, each at the time it was last
        current; the newest is the same)."""
        if self._lora_info is None:
            self._lora_info = Gauge(
                "vllite:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )
        labels = (str(max_loras), ",".join(waiting), ",".join(running))
        if self._lora_labels is not None and self._lora_labels != labels:
            self._lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this logger's registry, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ------------------------------------------------------------------ helpers
    def _gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(f"vllite:{name}", documentation, self._labelnames, registry=self.registry)

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(f"vllite:{name}", documentation, self._labelnames, registry=self.registry)

    def _histogram(self, name: str, documentation: str, buckets: Any) -> Histogram:
        return Histogram(f"vllite:{name}", documentation, self._labelnames, registry=self.registry, buckets=buckets)

    def _engine(self, engine_index: int) -> _EngineMetrics:
        metrics = self._engines.get(engine_index)
        if metrics is None:
            metrics = self._engines[engine_index] = _EngineMetrics(self, engine_index)
        return metrics


class _EngineMetrics:
    """One engine's labelled children of every metric (label lookups done once, not per batch)."""

    def __init__(self, parent: PrometheusStatLogger, engine_index: int) -> None:
        labels = (parent.model_name, str(engine_index))
        self.labels = labels
        self.running = parent._gauge_running.labels(*labels)
        self.waiting = parent._gauge_waiting.labels(*labels)
        self.kv_usage = parent._gauge_kv_usage.labels(*labels)
        self.prefix_queries = parent._prefix_queries.labels(*labels)
        self.prefix_hits = parent._prefix_hits.labels(*labels)
        self.preemptions = parent._preemptions.labels(*labels)
        self.prompt_tokens = parent._prompt_tokens.labels(*labels)
        self.generation_tokens = parent._generation_tokens.labels(*labels)
        self.ttft = parent._ttft.labels(*labels)
        self.itl = parent._itl.labels(*labels)
        self.tpot = parent._tpot.labels(*labels)
        self.e2e = parent._e2e.labels(*labels)
        self.queue_time = parent._queue_time.labels(*labels)
        self.prefill_time = parent._prefill_time.labels(*labels)
        self.decode_time = parent._decode_time.labels(*labels)
        self.inference_time = parent._inference_time.labels(*labels)
        self.prompt_tokens_hist = parent._request_prompt_tokens.labels(*labels)
        self.generation_tokens_hist = parent._request_generation_tokens.labels(*labels)
        self._request_success = parent._request_success
        self._spec_drafts = parent._spec_drafts.labels(*labels)
        self._spec_draft_tokens = parent._spec_draft_tokens.labels(*labels)
        self._spec_accepted_tokens = parent._spec_accepted_tokens.labels(*labels)
        self._spec_accepted_per_pos_family = parent._spec_accepted_per_pos
        self._spec_accepted_per_pos: list[Any] = []
        self._success: dict[str, Any] = {
            str(reason): parent._request_success.labels(*labels, str(reason)) for reason in FinishReason
        }

    def record_spec_decoding(self, stats: SpecDecodingStats) -> None:
        """Adds one step's speculative-decoding figures (the per-position series appear with the first)."""
        self._spec_drafts.inc(stats.num_drafts)
        self._spec_draft_tokens.inc(stats.num_draft_tokens)
        self._spec_accepted_tokens.inc(stats.num_accepted_tokens)
        per_pos = self._spec_accepted_per_pos
        while len(per_pos) < len(stats.num_accepted_tokens_per_pos):
            per_pos.append(self._spec_accepted_per_pos_family.labels(*self.labels, str(len(per_pos))))
        for counter, count in zip(per_pos, stats.num_accepted_tokens_per_pos):
            counter.inc(count)

    def success(self, finish_reason: str) -> Any:
        """The ``request_success`` counter of this engine for ``finish_reason``."""
        counter = self._success.get(finish_reason)
        if counter is None:
            counter = self._success[finish_reason] = self._request_success.labels(*self.labels, finish_reason)
        return counter
