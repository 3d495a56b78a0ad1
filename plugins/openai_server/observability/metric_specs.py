"""The table of the Prometheus metrics :class:`~vllite.plugins.openai_server.observability.metrics.PrometheusStatLogger`
exports: vLLM's v1 names (after the ``vllite:`` / ``vllm:`` prefix), help texts, labels and histogram buckets
(``vllm/v1/metrics/loggers.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

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
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
TOKENS = "tokens"  # a histogram's buckets: vLLM's 1-2-5 token counts up to the model's length
#: The ``reason`` labels of ``admission_rejections`` (vLLM's ``--max-num-queued-reqs`` / ``--max-num-queued-tokens``).
ADMISSION_REJECTION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class MetricSpec(NamedTuple):
    """One exported metric: its kind (``gauge``, ``counter`` or ``histogram``), its name after the prefix, its help
    text, its labels besides ``model_name`` and (``per_engine``) ``engine``, and a histogram's buckets (``TOKENS``:
    vLLM's 1-2-5 token-count buckets up to the model's length)."""

    kind: str
    name: str
    documentation: str
    labels: tuple[str, ...] = ()
    buckets: Sequence[float] | str = ()
    per_engine: bool = True


#: Every metric :class:`PrometheusStatLogger` exports (vLLM's names, help texts, labels and buckets).
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("gauge", "num_requests_running", "Number of requests in model execution batches."),
    MetricSpec("gauge", "num_requests_waiting", "Number of requests waiting to be processed."),
    MetricSpec(
        "gauge",
        "num_requests_waiting_by_reason",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
        "'deferred' = deferred by transient constraints (KV transfer, grammar compilation). "
        "Sum of all reasons equals num_requests_waiting.",
        labels=("reason",),
    ),
    MetricSpec(
        "gauge",
        "engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
        "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        labels=("sleep_state",),
    ),
    MetricSpec("gauge", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    MetricSpec("counter", "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    MetricSpec("counter", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    MetricSpec(
        "counter",
        "external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
        "queried tokens.",
    ),
    MetricSpec(
        "counter",
        "external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
        "cached tokens.",
    ),
    MetricSpec("counter", "num_preemptions", "Cumulative number of preemption from the engine."),
    MetricSpec("counter", "prompt_tokens", "Number of prefill tokens processed."),
    MetricSpec("counter", "prompt_tokens_by_source", "Number of prompt tokens by source.", labels=("source",)),
    MetricSpec("counter", "prompt_tokens_cached", "Number of cached prompt tokens (local + external)."),
    MetricSpec("counter", "prompt_tokens_recomputed", "Number of cached tokens recomputed for forward pass."),
    MetricSpec("counter", "generation_tokens", "Number of generation tokens processed."),
    MetricSpec("counter", "request_success", "Count of successfully processed requests.", labels=("finished_reason",)),
    MetricSpec("histogram", "request_prompt_tokens", "Number of prefill tokens processed.", buckets=TOKENS),
    MetricSpec("histogram", "request_generation_tokens", "Number of generation tokens processed.", buckets=TOKENS),
    MetricSpec(
        "histogram",
        "iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        buckets=ITERATION_TOKEN_BUCKETS,
    ),
    MetricSpec(
        "histogram",
        "request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        buckets=TOKENS,
    ),
    MetricSpec("histogram", "request_params_n", "Histogram of the n request parameter.", buckets=N_PARAM_BUCKETS),
    MetricSpec(
        "histogram", "request_params_max_tokens", "Histogram of the max_tokens request parameter.", buckets=TOKENS
    ),
    MetricSpec(
        "histogram", "time_to_first_token_seconds", "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS
    ),
    MetricSpec(
        "histogram",
        "inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        buckets=TOKEN_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "histogram",
        "request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        buckets=TOKEN_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "histogram",
        "e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        buckets=REQUEST_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "histogram",
        "request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        buckets=REQUEST_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "histogram",
        "request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        buckets=REQUEST_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "histogram",
        "request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        buckets=REQUEST_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "histogram",
        "request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        buckets=REQUEST_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "histogram",
        "request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        buckets=TOKENS,
    ),
    MetricSpec(
        "histogram",
        "request_num_preemptions",
        "Number of preemptions per finished request.",
        buckets=PREEMPTION_BUCKETS,
    ),
    MetricSpec("counter", "spec_decode_num_drafts", "Number of spec decoding drafts."),
    MetricSpec("counter", "spec_decode_num_draft_tokens", "Number of draft tokens."),
    MetricSpec("counter", "spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    MetricSpec(
        "counter",
        "spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=("position",),
    ),
    MetricSpec(
        "counter",
        "admission_rejections",
        "Number of admission attempts rejected.",
        labels=("reason",),
        per_engine=False,
    ),
)
