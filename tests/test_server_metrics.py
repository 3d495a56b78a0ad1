"""The server's Prometheus metrics (``vllite.plugins.openai_server.observability.metrics``): what ``record`` does with
given stats, and the exposition after real requests through an ``AsyncLLM`` on a tiny model."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_engine_proc import ensure_engine_proc_plugin
from vllite.engine.stats import FinishedRequestStats, IterationStats
from vllite.plugins.openai_server.observability.metrics import PrometheusStatLogger, buckets_1_2_5
from vllite.protocol import EngineInfo, SchedulerStats
from vllite.sampling_params import RequestOutputKind, SamplingParams
from vllite.testing import make_tiny_model_dir_cached

INFO = EngineInfo(max_model_len=128, num_gpu_blocks=64, block_size=16, max_num_batched_tokens=256, vocab_size=512)


def samples(metrics: PrometheusStatLogger) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition text, keyed by name and sorted labels (parsed, as a scraper would)."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(values: dict, name: str, engine: str = "0", model: str = "tiny", **labels: str) -> float:
    return values[name, tuple(sorted({"model_name": model, "engine": engine, **labels}.items()))]


def _finished(reason: str, e2e: float) -> FinishedRequestStats:
    return FinishedRequestStats(reason, e2e, 7, 3, 0.1, 0.2, 0.3, 0.5, 0.15)


def test_record_sets_gauges_and_adds_deltas_to_counters():
    metrics = PrometheusStatLogger("tiny", INFO)
    metrics.record(SchedulerStats(2, 1, 0.25, prefix_cache_queries=40, prefix_cache_hits=16, num_preemptions=1), None)
    it = IterationStats(num_prompt_tokens=7, num_generation_tokens=5, time_to_first_tokens_iter=[0.03, 0.3])
    it.inter_token_latencies_iter = [0.02, 0.02, 0.02]
    it.finished_requests = [_finished("length", 1.2), _finished("stop", 0.4)]
    metrics.record(SchedulerStats(0, 0, 0.0, prefix_cache_queries=10, prefix_cache_hits=0), it)
    metrics.record(None, IterationStats(num_generation_tokens=1), engine_index=1)
    v = samples(metrics)
    assert value(v, "vllite:num_requests_running") == 0 and value(v, "vllite:num_requests_waiting") == 0
    assert value(v, "vllite:kv_cache_usage_perc") == 0.0
    assert value(v, "vllite:prefix_cache_queries_total") == 50 and value(v, "vllite:prefix_cache_hits_total") == 16
    assert value(v, "vllite:num_preemptions_total") == 1
    assert value(v, "vllite:prompt_tokens_total") == 7 and value(v, "vllite:generation_tokens_total") == 5
    assert value(v, "vllite:generation_tokens_total", engine="1") == 1
    assert value(v, "vllite:request_success_total", finished_reason="length") == 1
    assert value(v, "vllite:request_success_total", finished_reason="stop") == 1
    assert value(v, "vllite:request_success_total", finished_reason="abort") == 0
    assert value(v, "vllite:time_to_first_token_seconds_count") == 2
    assert value(v, "vllite:time_to_first_token_seconds_bucket", le="0.04") == 1  # vLLM's buckets
    assert value(v, "vllite:inter_token_latency_seconds_count") == 3
    assert value(v, "vllite:inter_token_latency_seconds_sum") == pytest.approx(0.06)
    assert value(v, "vllite:e2e_request_latency_seconds_count") == 2
    assert value(v, "vllite:e2e_request_latency_seconds_bucket", le="0.5") == 1
    assert value(v, "vllite:e2e_request_latency_seconds_sum") == pytest.approx(1.6)
    assert value(v, "vllite:request_prefill_time_seconds_sum") == pytest.approx(0.4)
    assert value(v, "vllite:request_decode_time_seconds_sum") == pytest.approx(0.6)
    assert value(v, "vllite:request_inference_time_seconds_sum") == pytest.approx(1.0)
    assert value(v, "vllite:request_queue_time_seconds_sum") == pytest.approx(0.2)
    assert value(v, "vllite:request_prompt_tokens_sum") == 14
    assert value(v, "vllite:request_generation_tokens_bucket", le="2.0") == 0
    assert value(v, "vllite:request_generation_tokens_bucket", le="5.0") == 2


def test_token_buckets_and_registries_per_instance():
    assert buckets_1_2_5(128) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    first, second = PrometheusStatLogger("a", INFO), PrometheusStatLogger("b", INFO)  # no name clash
    first.record(None, IterationStats(num_prompt_tokens=3))
    assert value(samples(first), "vllite:prompt_tokens_total", model="a") == 3
    assert value(samples(second), "vllite:prompt_tokens_total", model="b") == 0


def test_exposition_after_real_requests():
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    ensure_engine_proc_plugin()
    llm = AsyncLLM(
        str(make_tiny_model_dir_cached("llama")),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        stat_loggers=[lambda info: PrometheusStatLogger("tiny", info)],
    )
    try:
        metrics = llm.stat_loggers[0]
        assert isinstance(metrics, PrometheusStatLogger)
        block_size = llm.engine_info.block_size
        shared = list(range(5, 5 + 2 * block_size + 3))  # two full blocks and a bit
        prompts = [list(range(10, 17)), list(range(30, 42)), list(range(50, 53)), shared]
        max_tokens = [4, 6, 3, 2]

        async def run(i: int, prompt: list[int], n: int) -> int:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            count = 0
            async for out in llm.generate({"prompt_token_ids": prompt}, params, f"m{i}"):
                count += len(out.outputs[0].token_ids)
            return count

        async def main() -> list[int]:
            produced = await asyncio.gather(*(run(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))))
            produced.append(await run(99, shared, 2))  # after the first copy finished: a prefix-cache hit
            return list(produced)

        produced = asyncio.run(main())
        assert produced == [*max_tokens, 2]
        all_prompts = [*prompts, shared]
        v = samples(metrics)
        assert value(v, "vllite:prompt_tokens_total") == sum(len(p) for p in all_prompts)
        assert value(v, "vllite:generation_tokens_total") == sum(produced)
        assert value(v, "vllite:e2e_request_latency_seconds_count") == len(all_prompts)
        assert value(v, "vllite:request_success_total", finished_reason="length") == len(all_prompts)
        assert value(v, "vllite:time_to_first_token_seconds_count") == len(all_prompts)
        assert value(v, "vllite:inter_token_latency_seconds_count") == sum(n - 1 for n in produced)
        assert value(v, "vllite:request_prompt_tokens_sum") == sum(len(p) for p in all_prompts)
        assert value(v, "vllite:request_generation_tokens_sum") == sum(produced)
        assert value(v, "vllite:num_requests_running") == 0 and value(v, "vllite:num_requests_waiting") == 0
        assert value(v, "vllite:kv_cache_usage_perc") == 0.0
        assert value(v, "vllite:prefix_cache_queries_total") == sum(len(p) for p in all_prompts)
        assert value(v, "vllite:prefix_cache_hits_total") == 2 * block_size
        assert value(v, "vllite:num_preemptions_total") == 0
        e2e_sum = value(v, "vllite:e2e_request_latency_seconds_sum")
        assert 0 < value(v, "vllite:request_inference_time_seconds_sum") < e2e_sum
    finally:
        llm.shutdown()


def test_external_prefix_cache_counters_with_a_kv_connector(tmp_path):
    """``external_prefix_cache_queries`` / ``_hits`` (vLLM's names) count the KV connector's lookups: a fresh engine
    on the directory another one filled finds the prompt's full blocks there."""
    import json

    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    ensure_engine_proc_plugin()
    kv = {"kv_connector": "shared-storage", "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    counts = []
    for _ in range(2):  # the second engine starts with an empty local prefix cache
        llm = AsyncLLM(
            str(make_tiny_model_dir_cached("llama")),
            dtype="float32",
            max_model_len=128,
            kv_transfer_config=json.dumps(kv),
            stat_loggers=[lambda info: PrometheusStatLogger("tiny", info)],
        )
        try:
            block_size = llm.engine_info.block_size
            prompt = list(range(5, 5 + 2 * block_size + 3))

            asyncio.run(_drain(llm, prompt))
            v = samples(llm.stat_loggers[0])
            counts.append(
                (
                    value(v, "vllite:external_prefix_cache_queries_total"),
                    value(v, "vllite:external_prefix_cache_hits_total"),
                )
            )
        finally:
            llm.shutdown()
    assert counts == [(len(prompt), 0), (len(prompt), 2 * block_size)]


async def _drain(llm, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    async for _ in llm.generate({"prompt_token_ids": prompt}, params, "r"):
        pass
