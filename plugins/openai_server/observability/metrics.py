"""Prometheus metrics for ``GET /metrics``: vLLM's v1 metric list, under the prefix ``vllite:`` (default) or ``vllm:``
(``vllite serve --metrics-prefix vllm``, so a dashboard built for vLLM works unchanged), fed as a ``StatLogger``.

Names, types, labels (``model_name``, ``engine``; ``finished_reason`` on ``request_success``, ``reason`` on
``num_requests_waiting_by_reason``, ``source`` on ``prompt_tokens_by_source``, ``sleep_state`` on
``engine_sleep_state``, ``position`` on ``spec_decode_num_accepted_tokens_per_pos``; ``admission_rejections`` has
``model_name`` and ``reason`` only) and histogram buckets are vLLM's (``vllm/v1/metrics/loggers.py``), one table in
:mod:`~vllite.plugins.openai_server.observability.metric_specs`. Counters show with a ``_total`` suffix in the
exposition, as vLLM's do. The metrics vLLM lists that vllite does not export are named, with the reason, in
docs/serving.md. Each logger has its own ``CollectorRegistry`` (several servers may share one process)::

    engine = AsyncLLM(config=config, stat_loggers=[lambda info: PrometheusStatLogger("my-model", info)])
    metrics = engine.stat_loggers[0]
    body, content_type = metrics.render()
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllite.config import compute_nans_in_logits_from_env
from vllite.engine.stats import IterationStats, PromptTokenStats
from vllite.plugins.openai_server.observability.metric_specs import (
    ADMISSION_REJECTION_REASONS,
    METRICS,
    SLEEP_STATES,
    TOKENS,
    WAITING_REASONS,
    MetricSpec,
)
from vllite.protocol import EngineInfo, FinishReason, SchedulerStats, SpecDecodingStats

METRICS_PREFIXES = ("vllite", "vllm")
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
    size and count). ``record_sleep_state`` sets ``engine_sleep_state``; ``record_admission_rejection`` (called by
    ``AsyncLLM`` for each request its admission limits refuse) adds to ``admission_rejections``. ``render()`` is the
    ``/metrics`` response.
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
        self._families: dict[str, Any] = {spec.name: self._metric(spec, token_buckets) for spec in METRICS}
        for reason in ADMISSION_REJECTION_REASONS:  # both series show (at zero) before the first refusal
            self._families["admission_rejections"].labels(model_name, reason)
        # As vLLM: only when NaN logits are counted ($VLLITE_COMPUTE_NANS_IN_LOGITS or $VLLM_COMPUTE_NANS_IN_LOGITS).
        self._corrupted_requests = (
            self._counter(
                "corrupted_requests", "Corrupted requests, in terms of total number of requests with NaNs in logits."
            )
            if compute_nans_in_logits_from_env()
            else None
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

    def record_admission_rejection(self, reason: str) -> None:
        """Counts one request refused at admission: ``reason`` is ``max_num_queued_reqs`` or ``max_num_queued_tokens``
        (one count per request, whatever its ``n``, as vLLM)."""
        if reason not in ADMISSION_REJECTION_REASONS:
            raise ValueError(
                f"admission rejection reason must be one of {ADMISSION_REJECTION_REASONS}, got {reason!r}."
            )
        self._families["admission_rejections"].labels(self.model_name, reason).inc()

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
                multiprocess_mode="mostrecent",
            )
        labels = (str(max_loras), ",".join(waiting), ",".join(running))
        if self._lora_labels is not None and self._lora_labels != labels:
            self._lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this logger's registry, and its content type; in prometheus-client's
        multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by ``vllite serve --api-server-count N``), of every
        process writing to that directory: counters and histograms summed, gauges the most recent value."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ------------------------------------------------------------------ helpers
    def _metric(self, spec: MetricSpec, token_buckets: Sequence[float]) -> Any:
        if spec.kind == "histogram":
            return self._histogram(
                spec.name, spec.documentation, token_buckets if spec.buckets == TOKENS else spec.buckets
            )
        if spec.kind == "gauge":
            return self._gauge(spec.name, spec.documentation, list(spec.labels))
        return self._counter(spec.name, spec.documentation, list(spec.labels), per_engine=spec.per_engine)

    def _gauge(self, name: str, documentation: str, extra: list[str] | None = None) -> Gauge:
        labels = [*self._labelnames, *(extra or [])]
        # With several API servers (prometheus-client's multiprocess mode) a gauge shows the latest value set by any
        # of them, as vLLM's; in one process the mode changes nothing.
        return Gauge(
            f"{self.prefix}:{name}", documentation, labels, registry=self.registry, multiprocess_mode="mostrecent"
        )

    def _counter(
        self, name: str, documentation: str, extra: list[str] | None = None, per_engine: bool = True
    ) -> Counter:
        labels = [*(self._labelnames if per_engine else self._labelnames[:1]), *(extra or [])]
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
                multiprocess_mode="mostrecent",
            )
        self._cache_config_info.labels(**info, engine=str(engine_index)).set(1)


class _EngineMetrics:
    """One engine's labelled children of every metric (label lookups done once, not per batch)."""

    def __init__(self, parent: PrometheusStatLogger, engine_index: int) -> None:
        labels = (parent.model_name, str(engine_index))
        self.labels = labels
        p, f = parent, parent._families
        self.running = f["num_requests_running"].labels(*labels)
        self.waiting = f["num_requests_waiting"].labels(*labels)
        self.waiting_by_reason = {r: f["num_requests_waiting_by_reason"].labels(*labels, r) for r in WAITING_REASONS}
        self.sleep_state = {s: f["engine_sleep_state"].labels(*labels, s) for s in SLEEP_STATES}
        self.sleep_state["awake"].set(1)
        self.kv_usage = f["kv_cache_usage_perc"].labels(*labels)
        self.prefix_queries = f["prefix_cache_queries"].labels(*labels)
        self.prefix_hits = f["prefix_cache_hits"].labels(*labels)
        self.external_prefix_queries = f["external_prefix_cache_queries"].labels(*labels)
        self.external_prefix_hits = f["external_prefix_cache_hits"].labels(*labels)
        self.preemptions = f["num_preemptions"].labels(*labels)
        corrupted = p._corrupted_requests
        self.corrupted_requests = corrupted.labels(*labels) if corrupted is not None else None
        self.prompt_tokens = f["prompt_tokens"].labels(*labels)
        self.prompt_tokens_by_source = {
            source: f["prompt_tokens_by_source"].labels(*labels, source) for source in PromptTokenStats.ALL_SOURCES
        }
        self.prompt_tokens_cached = f["prompt_tokens_cached"].labels(*labels)
        self.prompt_tokens_recomputed = f["prompt_tokens_recomputed"].labels(*labels)
        self.generation_tokens = f["generation_tokens"].labels(*labels)
        self.iteration_tokens = f["iteration_tokens_total"].labels(*labels)
        self.max_num_generation_tokens = f["request_max_num_generation_tokens"].labels(*labels)
        self.n_param = f["request_params_n"].labels(*labels)
        self.max_tokens_param = f["request_params_max_tokens"].labels(*labels)
        self.ttft = f["time_to_first_token_seconds"].labels(*labels)
        self.itl = f["inter_token_latency_seconds"].labels(*labels)
        self.tpot = f["request_time_per_output_token_seconds"].labels(*labels)
        self.e2e = f["e2e_request_latency_seconds"].labels(*labels)
        self.queue_time = f["request_queue_time_seconds"].labels(*labels)
        self.prefill_time = f["request_prefill_time_seconds"].labels(*labels)
        self.decode_time = f["request_decode_time_seconds"].labels(*labels)
        self.inference_time = f["request_inference_time_seconds"].labels(*labels)
        self.prompt_tokens_hist = f["request_prompt_tokens"].labels(*labels)
        self.generation_tokens_hist = f["request_generation_tokens"].labels(*labels)
        self.prefill_kv_computed = f["request_prefill_kv_computed_tokens"].labels(*labels)
        self.num_preemptions_hist = f["request_num_preemptions"].labels(*labels)
        self._request_success = f["request_success"]
        self._spec_drafts = f["spec_decode_num_drafts"].labels(*labels)
        self._spec_draft_tokens = f["spec_decode_num_draft_tokens"].labels(*labels)
        self._spec_accepted_tokens = f["spec_decode_num_accepted_tokens"].labels(*labels)
        self._spec_accepted_per_pos_family = f["spec_decode_num_accepted_tokens_per_pos"]
        self._spec_accepted_per_pos: list[Any] = []
        self._success: dict[str, Any] = {
            str(reason): f["request_success"].labels(*labels, str(reason)) for reason in FinishReason
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
        if self.corrupted_requests is not None:
            self.corrupted_requests.inc(it.num_corrupted_reqs)
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
            self.num_preemptions_hist.observe(finished.num_preemptions)
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
