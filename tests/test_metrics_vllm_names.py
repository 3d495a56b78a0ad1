"""A Grafana-style check of ``vllite serve --metrics-prefix vllm``: after a few requests, every metric name vLLM's
documentation lists for the v1 engine answers in ``/metrics`` under its ``vllm:`` name, or is listed in
docs/serving.md (between the ``metrics-not-exported`` markers) with the reason it cannot; plus the figures of the
metrics added for vLLM parity, fed by real requests."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllite.plugins.openai_server.testing import RemoteServer
from vllite.testing import make_tiny_model_dir_cached

DOCS = Path(__file__).resolve().parent.parent / "docs" / "serving.md"

#: vLLM's v1 metric names (``vllm/v1/metrics/loggers.py``, its spec-decoding and perf loggers; the list the
#: "Production Metrics" page renders), as a dashboard queries them.
VLLM_V1_METRICS = (
    # gauges
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason",
    "vllm:engine_sleep_state",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
    # counters
    "vllm:corrupted_requests",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:mm_cache_queries",
    "vllm:mm_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_by_source",
    "vllm:prompt_tokens_cached",
    "vllm:prompt_tokens_recomputed",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "vllm:estimated_flops_per_gpu_total",
    "vllm:estimated_read_bytes_per_gpu_total",
    "vllm:estimated_write_bytes_per_gpu_total",
    "vllm:admission_rejections",
    # histograms
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prefill_kv_computed_tokens",
    "vllm:request_num_preemptions",
    "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_idle_before_evict_seconds",
    "vllm:kv_block_reuse_gap_seconds",
)


def documented_missing() -> dict[str, str]:
    """The ``vllm:`` names docs/serving.md lists as not exported, each with its reason."""
    text = DOCS.read_text()
    block = text.split("<!-- metrics-not-exported -->", 1)[1].split("<!-- /metrics-not-exported -->", 1)[0]
    missing = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`vllm:"):
            continue
        for name in re.findall(r"`(vllm:[a-z0-9_]+)`", cells[0]):
            missing[name] = cells[-1]
    return missing


def scrape(url: str) -> dict[str, list]:
    """The exposition's metric families by name (counters under their name with and without ``_total``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    families: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family.samples
        if family.type == "counter":
            families[family.name + "_total"] = family.samples
    return families


def sample(families: dict[str, list], name: str, **labels: str) -> float:
    base = re.sub(r"_(total|sum|count|bucket)$", "", name)
    for candidate in (name, base):
        for s in families.get(candidate, []):
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError((name, labels))


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server():
    model = str(make_tiny_model_dir_cached("llama"))
    args = [model, "--served-model-name", "tiny", "--max-model-len", "256", "--dtype", "float32"]
    with RemoteServer([*args, "--metrics-prefix", "vllm", "--block-size", "16"]) as remote:
        prompt = list(range(10, 10 + 2 * 16 + 1))  # two full blocks and one token
        for _ in range(2):  # the second is a prefix-cache hit
            post(
                remote.url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            )
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "n": 2, "seed": 1, "ignore_eos": True}
        post(remote.url, "/v1/completions", body)
        yield remote


def test_every_vllm_v1_metric_exists_or_is_documented(server):
    families = scrape(server.url)
    missing = documented_missing()
    assert missing, "docs/serving.md lost its metrics-not-exported list"
    assert all(reason for reason in missing.values())
    absent = [name for name in VLLM_V1_METRICS if name not in families and name not in missing]
    assert not absent, f"vLLM metrics neither exported nor documented as missing: {absent}"
    exported_but_listed = [name for name in missing if name in families]
    assert not exported_but_listed, f"listed as not exported, but exported: {exported_but_listed}"
    assert not any(name.startswith("vllite:") for name in families)


def test_request_param_histograms(server):
    families = scrape(server.url)
    labels = {"model_name": "tiny", "engine": "0"}
    # Three original requests; the n=2 one is observed once, when both of its sequences are done.
    assert sample(families, "vllm:request_params_n_count", **labels) == 3
    assert sample(families, "vllm:request_params_n_sum", **labels) == 1 + 1 + 2
    assert sample(families, "vllm:request_params_n_bucket", le="1.0", **labels) == 2
    assert sample(families, "vllm:request_params_max_tokens_sum", **labels) == 4 + 4 + 3 + 3  # per sequence
    assert sample(families, "vllm:request_max_num_generation_tokens_sum", **labels) == 4 + 4 + 3


def test_parity_metrics_carry_the_requests_figures(server):
    families = scrape(server.url)
    labels = {"model_name": "tiny", "engine": "0"}
    assert sample(families, "vllm:iteration_tokens_total_count", **labels) > 0
    generated = sample(families, "vllm:generation_tokens_total", **labels)
    prompted = sample(families, "vllm:prompt_tokens_total", **labels)
    assert sample(families, "vllm:iteration_tokens_total_sum", **labels) == generated + prompted
    # The second copy of the long prompt hit its two full blocks (32 of 33 tokens): vLLM counts the last token,
    # computed anyway for the logits, as a recomputed cache hit.
    assert sample(families, "vllm:prompt_tokens_cached_total", **labels) == 2 * 16
    assert sample(families, "vllm:prompt_tokens_by_source_total", source="local_cache_hit", **labels) == 2 * 16 + 1
    assert sample(families, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer", **labels) == 0
    computed = sample(families, "vllm:prompt_tokens_by_source_total", source="local_compute", **labels)
    assert computed == prompted - 2 * 16
    assert sample(families, "vllm:prompt_tokens_recomputed_total", **labels) == 1
    kv_computed = sample(families, "vllm:request_prefill_kv_computed_tokens_sum", **labels)
    assert kv_computed == computed
    assert sample(families, "vllm:num_requests_waiting_by_reason", reason="capacity", **labels) == 0
    assert sample(families, "vllm:num_requests_waiting_by_reason", reason="deferred", **labels) == 0
    assert sample(families, "vllm:engine_sleep_state", sleep_state="awake", **labels) == 1
    assert sample(families, "vllm:engine_sleep_state", sleep_state="discard_all", **labels) == 0
    info = families["vllm:cache_config_info"]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["block_size"] == "16" and info[0].labels["engine"] == "0"
    assert int(info[0].labels["num_gpu_blocks"]) > 0 and info[0].labels["enable_prefix_caching"] == "True"


def test_stats_group_n_children_and_split_prompt_sources():
    from vllite.engine.parallel_sampling import ParentRequest
    from vllite.engine.stats import IterationStats, RequestStateStats
    from vllite.protocol import EngineCoreRequest
    from vllite.sampling_params import SamplingParams

    request = EngineCoreRequest("r", [1, 2, 3, 4, 5], SamplingParams(n=2, max_tokens=7, temperature=0.5), None, 1.0)
    parent = ParentRequest(request, "ext")
    children = [RequestStateStats.for_request(request, None, parent) for _ in range(2)]
    assert children[0].siblings is children[1].siblings and children[0].params.n == 2
    it = IterationStats()
    children[0].record_tokens(3, 4, now=2.0, prompt_len=5, iteration=it)  # 4 of 5 cached: the 5th recomputed
    children[1].record_tokens(5, 0, now=2.0, prompt_len=5, iteration=it)
    it.record_finished("length", 5, children[0])
    assert it.n_params_iter == [] and it.max_num_generation_tokens_iter == []  # one child still running
    it.record_finished("length", 5, children[1])
    assert it.n_params_iter == [2] and it.max_num_generation_tokens_iter == [5]
    sources = it.prompt_token_stats
    assert (sources.computed, sources.local_cache_hit, sources.cached_tokens, sources.recomputed_tokens) == (6, 5, 4, 1)
    assert sources.computed + sources.local_cache_hit - sources.recomputed_tokens == sources.total == 10
    finished = it.finished_requests[0]
    assert finished.max_tokens_param == 7 and finished.num_prefill_kv_computed_tokens == 1
    assert finished.params is not None and finished.params.temperature == 0.5
    with pytest.raises(ValueError, match="source"):
        sources.get_by_source("disk")


def test_logger_prefix_sleep_state_and_waiting_reasons():
    from vllite.plugins.openai_server.observability.metrics import PrometheusStatLogger
    from vllite.protocol import EngineInfo, SchedulerStats

    info = EngineInfo(max_model_len=128, num_gpu_blocks=64, block_size=16, max_num_batched_tokens=256, vocab_size=512)
    with pytest.raises(ValueError, match="prefix"):
        PrometheusStatLogger("m", info, prefix="vllm:")
    metrics = PrometheusStatLogger("m", info, prefix="vllm", cache_config={"cache_dtype": "auto"})
    metrics.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=5, num_skipped_waiting_reqs=2), None)
    metrics.record_sleep_state(2)
    with pytest.raises(ValueError, match="sleep level"):
        metrics.record_sleep_state(3)
    families: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        families[family.name] = family.samples
    labels = {"model_name": "m", "engine": "0"}
    assert sample(families, "vllm:num_requests_waiting", **labels) == 5
    assert sample(families, "vllm:num_requests_waiting_by_reason", reason="capacity", **labels) == 3
    assert sample(families, "vllm:num_requests_waiting_by_reason", reason="deferred", **labels) == 2
    assert sample(families, "vllm:engine_sleep_state", sleep_state="discard_all", **labels) == 1
    assert sample(families, "vllm:engine_sleep_state", sleep_state="awake", **labels) == 0
    info_labels = families["vllm:cache_config_info"][0].labels
    assert info_labels == {"block_size": "16", "cache_dtype": "auto", "num_gpu_blocks": "64", "engine": "0"}


def test_scheduler_stats_count_blocked_waiting_requests_as_deferred():
    from vllite.request import RequestStatus
    from vllite.sched import Scheduler
    from vllite.testing import make_config, make_request

    scheduler = Scheduler(make_config(), num_blocks=64, log_stats=True)
    for i in range(3):
        scheduler.add_request(make_request(scheduler, f"r{i}", [1, 2, 3], max_tokens=2))
    next(iter(scheduler.waiting)).status = RequestStatus.WAITING_FOR_REMOTE_KVS  # a KV load still under way
    stats = scheduler.make_stats()
    assert stats is not None and (stats.num_waiting_reqs, stats.num_skipped_waiting_reqs) == (3, 1)


def test_preemptions_per_request_and_admission_rejections_under_the_vllite_prefix():
    """``request_num_preemptions`` (vLLM's histogram: preemptions per finished request) carries the preemptions a
    KV cache too small for the batch forces (its sum is ``num_preemptions``), and ``admission_rejections`` is
    exported, under the default ``vllite:`` prefix too. Requests go through the ``openai`` client."""
    openai = pytest.importorskip("openai")
    model = str(make_tiny_model_dir_cached("llama"))
    args = [model, "--served-model-name", "tiny", "--max-model-len", "176", "--dtype", "float32"]
    args += ["--block-size", "16", "--num-gpu-blocks-override", "12", "--no-enable-prefix-caching"]
    with RemoteServer(args) as remote:
        with openai.OpenAI(base_url=remote.base_url, api_key="unused", max_retries=0) as client:
            # 6 sequences of up to 7 blocks each share 12 blocks: the scheduler must preempt to finish them all.
            response = client.completions.create(
                model="tiny", prompt="Hi", n=6, max_tokens=100, seed=0, extra_body={"ignore_eos": True}
            )
        assert [c.finish_reason for c in response.choices] == ["length"] * 6
        families = scrape(remote.url)
    labels = {"model_name": "tiny", "engine": "0"}
    preemptions = sample(families, "vllite:num_preemptions_total", **labels)
    assert preemptions > 0, "the small KV cache was meant to force preemptions"
    assert sample(families, "vllite:request_num_preemptions_count", **labels) == 6
    assert sample(families, "vllite:request_num_preemptions_sum", **labels) == preemptions
    assert sample(families, "vllite:request_num_preemptions_bucket", le="+Inf", **labels) == 6
    assert "vllite:admission_rejections" in families
    rejections = {s.labels["reason"]: s.value for s in families["vllite:admission_rejections"]}
    assert rejections == {"max_num_queued_reqs": 0.0, "max_num_queued_tokens": 0.0}
