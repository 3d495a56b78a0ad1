"""Prometheus metrics for ``GET /metrics``: vLLM's v1 metric list, under the prefix ``vllite:`` (default) or ``vllm:``
(``vllite serve --metrics-prefix vllm``, so a dashboard built for vLLM works unchanged), fed as a ``StatLogger``.

Names, types, labels (``model_name``, ``engine``; ``finished_reason`` on ``request_success``, ``reason`` on
``num_requests_waiting_by_reason``, ``source`` on ``prompt_tokens_by_source``, ``sleep_state`` on
``engine_sleep_state``, ``position`` on ``spec_decode_num_accepted_tokens_per_pos``) and histogram buckets are
vLLM's (``vllm/v1/metrics/loggers.py``). Counters show with a ``_total`` suffix in the exposition, as vLLM's do.
The metrics vLLM lists that vllite does not export are named, with the reason, in docs/serving.md. Each logger has
its own ``CollectorRegistry`` (several servers may share one process)::

    engine = AsyncLLM(config=config, stat_loggers=[lambda info: PrometheusStatLogger("my-model", info)])
    metrics = engine.stat_loggers[0]
    body, content_type = metrics.render()
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllite.engine.stats import IterationStats, PromptTokenStats
from vllite.protocol import EngineInfo, FinishReason, SchedulerStats, SpecDecodingStats

METRICS_PREFIXES = ("vllite", "vllm")
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
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_PARAM_BUCKETS = (1, 2, 5, 10, 20)
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
    """A ``StatLogger`` that keeps vLLM's Prometheus metrics (prefix ``prefix:``) in its own registry.

    Gauges hold the latest ``SchedulerStats`` (running, waiting by reason, KV-cache usage); the scheduler's
    prefix-cache, preemption and speculative-decoding figures, which are deltas since its previous stats, are added
    to counters; token counters, ``iteration_tokens_total``, the prompt-token sources and the TTFT / inter-token
    histograms come from each ``IterationStats``, the per-request histograms and ``request_success`` from its
    finished requests. ``cache_config_info`` is set once (``cache_config`` adds its fields to the engine's block
    size and count). ``record_sleep_state`` sets ``engine_sleep_state``. ``render()`` is the ``/metrics`` response.
    """

    def __init__(
        self,
        model_name: str,
        engine_info: EngineInfo,
        registry: CollectorRegistry | None = None,
        prefix: str = "vllite",
        cache_config: Mapping[str, Any] | None = None,
    ) -> None:
        if not _PREFIX.fullmatch(prefix):
            raise ValueError(f"metrics prefix must be a Prometheus name ([A-Za-z_][A-Za-z0-9_]*), got {prefix!r}.")
        self.model_name = model_name
        self.prefix = prefix
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labelnames = ["model_name", "engine"]
        token_buckets = buckets_1_2_5(int(engine_info.max_model_len))

        gauge, counter, histogram = self._gauge, self._counter, self._histogram
        self._gauge_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self._gauge_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self._gauge_waiting_by_reason = gauge(
            "num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (KV transfer, grammar compilation). "
            "Sum of all reasons equals num_requests_waiting.",
            extra=["reason"],
        )
        self._gauge_sleep_state = gauge(
            "engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            extra=["sleep_state"],
        )
        self._gauge_kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self._prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self._external_prefix_queries = counter(
            "external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens.",
        )
        self._external_prefix_hits = counter(
            "external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
            "cached tokens.",
        )
        self._preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self._prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self._prompt_tokens_by_source = counter(
            "prompt_tokens_by_source", "Number of prompt tokens by source.", extra=["source"]
        )
        self._prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self._prompt_tokens_recomputed = counter(
            "prompt_tokens_recomputed", "Number of cached tokens recomputed for forward pass."
        )
        self._generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._request_success = counter(
            "request_success", "Count of successfully processed requests.", extra=["finished_reason"]
        )
        self._request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self._request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self._iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS
        )
        self._max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self._n_param = histogram("request_params_n", "Histogram of the n request parameter.", N_PARAM_BUCKETS)
        self._max_tokens_param = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self._ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self._itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS
        )
        self._tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self._e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self._queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prefill_kv_computed = histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )
        self._spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self._spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self._spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", extra=["position"]
        )
        self._cache_config = {"block_size": engine_info.block_size, **(cache_config or {})}
        self._cache_config.setdefault("num_gpu_blocks", engine_info.num_gpu_blocks)
        self._cache_config_info: Gauge | None = None
        self._engines: dict[int, _EngineMetrics] = {}
        self._engine(0)  # engine 0's series show (at zero) before the first request
        self._lora_info: Gauge | None = None  # lora_requests_info, made by the first record_lora_states()
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
            m.record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            m.record_iteration(iteration_stats)

    def record_sleep_state(self, level: int, engine_index: int = 0) -> None:
        """Sets ``engine_sleep_state``: level 0 is awake (``awake=1``), level 1 ``weights_offloaded=1``, level 2
        ``discard_all=1`` (the other series 0). ``ValueError`` for another level."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}.")
        for state, child in self._engine(engine_index).sleep_state.items():
            child.set(1 if SLEEP_STATES.index(state) == level else 0)

    def record_lora_states(self, max_loras: int, waiting: list[str], running: list[str]) -> None:
        """Sets vLLM's ``lora_requests_info`` gauge: labels ``max_lora``, ``waiting_lora_adapters`` and
        ``running_lora_adapters`` (the adapters of the requests waiting and running, comma-joined), value the
        current time. Only the latest label set is kept (vLLM keeps every one seen, each at the time it was last
        current; the newest is the same)."""
        if self._lora_info is None:
            self._lora_info = Gauge(
                f"{self.prefix}:lora_requests_info",
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
    def _gauge(self, name: str, documentation: str, extra: list[str] | None = None) -> Gauge:
        labels = [*self._labelnames, *(extra or [])]
        return Gauge(f"{self.prefix}:{name}", documentation, labels, registry=self.registry)

    def _counter(self, name: str, documentation: str, extra: list[str] | None = None) -> Counter:
        labels = [*self._labelnames, *(extra or [])]
        return Counter(f"{self.prefix}:{name}", documentation, labels, registry=self.registry)

    def _histogram(self, name: str, documentation: str, buckets: Any) -> Histogram:
        return Histogram(
            f"{self.prefix}:{name}", documentation, self._labelnames, registry=self.registry, buckets=buckets
        )

    def _engine(self, engine_index: int) -> _EngineMetrics:
        metrics = self._engines.get(engine_index)
        if metrics is None:
            metrics = self._engines[engine_index] = _EngineMetrics(self, engine_index)
            self._set_cache_config_info(engine_index)
        return metrics

    def _set_cache_config_info(self, engine_index: int) -> None:
        """``cache_config_info``: a gauge at 1 whose labels are the cache config's fields and ``engine`` (vLLM's
        Info-as-gauge; no ``model_name`` label, as in vLLM)."""
        info = {key: str(value) for key, value in self._cache_config.items()}
        if self._cache_config_info is None:
            self._cache_config_info = Gauge(
                f"{self.prefix}:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                [*info, "engine"],
                registry=self.registry,
            )
        self._cache_config_info.labels(**info, engine=str(engine_index)).set(1)


class _EngineMetrics:
    """One engine's labelled children of every metric (label lookups done once, not per batch)."""

    def __init__(self, parent: PrometheusStatLogger, engine_index: int) -> None:
        labels = (parent.model_name, str(engine_index))
        self.labels = labels
        p = parent
        self.running = p._gauge_running.labels(*labels)
        self.waiting = p._gauge_waiting.labels(*labels)
        self.waiting_by_reason = {r: p._gauge_waiting_by_reason.labels(*labels, r) for r in WAITING_REASONS}
        self.sleep_state = {s: p._gauge_sleep_state.labels(*labels, s) for s in SLEEP_STATES}
        self.sleep_state["awake"].set(1)
        self.kv_usage = p._gauge_kv_usage.labels(*labels)
        self.prefix_queries = p._prefix_queries.labels(*labels)
        self.prefix_hits = p._prefix_hits.labels(*labels)
        self.external_prefix_queries = p._external_prefix_queries.labels(*labels)
        self.external_prefix_hits = p._external_prefix_hits.labels(*labels)
        self.preemptions = p._preemptions.labels(*labels)
        self.prompt_tokens = p._prompt_tokens.labels(*labels)
        self.prompt_tokens_by_source = {
            source: p._prompt_tokens_by_source.labels(*labels, source) for source in PromptTokenStats.ALL_SOURCES
        }
        self.prompt_tokens_cached = p._prompt_tokens_cached.labels(*labels)
        self.prompt_tokens_recomputed = p._prompt_tokens_recomputed.labels(*labels)
        self.generation_tokens = p._generation_tokens.labels(*labels)
        self.iteration_tokens = p._iteration_tokens.labels(*labels)
        self.max_num_generation_tokens = p._max_num_generation_tokens.labels(*labels)
        self.n_param = p._n_param.labels(*labels)
        self.max_tokens_param = p._max_tokens_param.labels(*labels)
        self.ttft = p._ttft.labels(*labels)
        self.itl = p._itl.labels(*labels)
        self.tpot = p._tpot.labels(*labels)
        self.e2e = p._e2e.labels(*labels)
        self.queue_time = p._queue_time.labels(*labels)
        self.prefill_time = p._prefill_time.labels(*labels)
        self.decode_time = p._decode_time.labels(*labels)
        self.inference_time = p._inference_time.labels(*labels)
        self.prompt_tokens_hist = p._request_prompt_tokens.labels(*labels)
        self.generation_tokens_hist = p._request_generation_tokens.labels(*labels)
        self.prefill_kv_computed = p._prefill_kv_computed.labels(*labels)
        self._request_success = p._request_success
        self._spec_drafts = p._spec_drafts.labels(*labels)
        self._spec_draft_tokens = p._spec_draft_tokens.labels(*labels)
        self._spec_accepted_tokens = p._spec_accepted_tokens.labels(*labels)
        self._spec_accepted_per_pos_family = p._spec_accepted_per_pos
        self._spec_accepted_per_pos: list[Any] = []
        self._success: dict[str, Any] = {
            str(reason): p._request_success.labels(*labels, str(reason)) for reason in FinishReason
        }

    def record_scheduler(self, stats: SchedulerStats) -> None:
        """The gauges from one ``SchedulerStats``; its deltas added to the counters."""
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        deferred = min(stats.num_skipped_waiting_reqs, stats.num_waiting_reqs)
        self.waiting_by_reason["capacity"].set(stats.num_waiting_reqs - deferred)
        self.waiting_by_reason["deferred"].set(deferred)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        self.external_prefix_queries.inc(stats.external_prefix_cache_queries)
        self.external_prefix_hits.inc(stats.external_prefix_cache_hits)
        self.preemptions.inc(stats.num_preemptions)
        if stats.spec_decoding_stats is not None:
            self.record_spec_decoding(stats.spec_decoding_stats)

    def record_iteration(self, it: IterationStats) -> None:
        """The token counters and histograms of one batch, and its finished requests' figures."""
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        sources = it.prompt_token_stats
        for source, counter in self.prompt_tokens_by_source.items():
            counter.inc(sources.get_by_source(source))
        self.prompt_tokens_cached.inc(sources.cached_tokens)
        self.prompt_tokens_recomputed.inc(sources.recomputed_tokens)
        if it.num_prompt_tokens or it.num_generation_tokens:  # not the bare stats of client aborts
            self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        for ttft in it.time_to_first_tokens_iter:
            self.ttft.observe(ttft)
        for itl in it.inter_token_latencies_iter:
            self.itl.observe(itl)
        for n in it.n_params_iter:
            self.n_param.observe(n)
        for num_tokens in it.max_num_generation_tokens_iter:
            self.max_num_generation_tokens.observe(num_tokens)
        for finished in it.finished_requests:
            self.success(finished.finish_reason).inc()
            self.e2e.observe(finished.e2e_latency)
            self.queue_time.observe(finished.queued_time)
            self.prefill_time.observe(finished.prefill_time)
            self.decode_time.observe(finished.decode_time)
            self.inference_time.observe(finished.inference_time)
            self.tpot.observe(finished.mean_time_per_output_token)
            self.prompt_tokens_hist.observe(finished.num_prompt_tokens)
            self.generation_tokens_hist.observe(finished.num_generation_tokens)
            self.prefill_kv_computed.observe(finished.num_prefill_kv_computed_tokens)
            if finished.max_tokens_param:
                self.max_tokens_param.observe(finished.max_tokens_param)

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
