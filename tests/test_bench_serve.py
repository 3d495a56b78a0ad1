"""``vllite bench serve``: arrivals, datasets, percentiles, SSE parsing, and the measured figures against a scripted
server whose chunk timing is known."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from tests.fake_openai import serve_app, sse_write
from vllite.plugins.bench.serve import bench_serve, request_body
from vllite.plugins.bench.serve_client import RequestResult, SSEDecoder
from vllite.plugins.bench.serve_config import ServeBenchConfig
from vllite.plugins.bench.serve_metrics import format_table, percentile, summarize
from vllite.plugins.bench.serve_requests import BenchRequest, JsonlDataset, RandomDataset, arrival_times

# The scripted stream: an empty (role) chunk at once, the first token chunk after FIRST_DELAY, then one chunk of
# TOKENS_PER_CHUNK tokens every GAP seconds until max_tokens, a usage chunk, [DONE].
FIRST_DELAY, GAP, TOKENS_PER_CHUNK = 0.2, 0.1, 2
SLACK = 0.09  # a loaded 2-core machine oversleeps; no measurement of the wrong event fits in this window


# ---------------------------------------------------------------------------------------------- pure parts
def test_poisson_arrivals_have_mean_gap_one_over_rate():
    times = arrival_times(20001, 4.0, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0 and times == sorted(times)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert arrival_times(50, 4.0, seed=1) == times[:50]  # seeded
    assert arrival_times(50, 4.0, seed=2) != times[:50]


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    times = arrival_times(20001, 2.0, burstiness=0.25, seed=3)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(4.0, rel=0.15)  # gamma shape k: CV^2 = 1/k


def test_infinite_rate_is_a_burst_and_bad_rates_are_rejected():
    assert arrival_times(5, math.inf) == [0.0] * 5
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_times(3, rate, burstiness)


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) == 0.0


def test_random_dataset_lengths_and_reproducibility(tmp_path):
    data = RandomDataset(100, 20, range_ratio=0.5, vocab_size=50, seed=7)
    requests = [data[i] for i in range(300)]
    assert all(50 <= len(r.prompt) <= 150 and r.prompt_len == len(r.prompt) for r in requests)
    assert all(10 <= r.max_tokens <= 30 for r in requests)
    assert all(0 <= t < 50 for r in requests for t in r.prompt)
    assert len({len(r.prompt) for r in requests}) > 50  # spread over the range, not one length
    assert data[5] == RandomDataset(100, 20, range_ratio=0.5, vocab_size=50, seed=7)[5]
    assert RandomDataset(8, 4, vocab_size=50)[0].max_tokens == 4  # ratio 0: exact lengths
    with pytest.raises(ValueError):
        RandomDataset(8, 4, range_ratio=1.0, vocab_size=50)
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi", "max_tokens": 3}\n# comment\n\n{"prompt": [1, 2]}\n')
    jsonl = JsonlDataset(path, default_max_tokens=9)
    assert len(jsonl) == 2 and jsonl[1].prompt == [1, 2] and jsonl[1].max_tokens == 9 and jsonl[2] == jsonl[0]
    path.write_text('{"max_tokens": 3}\n')
    with pytest.raises(ValueError, match=":1: bad request record"):
        JsonlDataset(path, 4)


def test_sse_decoder_survives_any_split():
    stream = 'data: {"a": 1}\n\n: keep-alive\n\ndata: {"b": "é"}\r\n\r\ndata: [DONE]\n\n'.encode()
    expected = ['{"a": 1}', '{"b": "é"}', "[DONE]"]
    for cut in range(len(stream) + 1):
        decoder = SSEDecoder()
        assert decoder.feed(stream[:cut]) + decoder.feed(stream[cut:]) + decoder.flush() == expected
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x") == [] and decoder.flush() == ["x"]


def test_summary_from_known_results():
    ok = RequestResult(success=True, ttft=0.1, itl=[0.02, 0.04], latency=0.16, output_tokens=3, prompt_tokens=10)
    ok2 = RequestResult(success=True, ttft=0.3, itl=[], latency=0.3, output_tokens=1)
    bad = RequestResult(success=False, error="HTTP 500: boom")
    summary = summarize([ok, bad, ok2], 2.0, prompt_lens=[10, 5, 7])
    assert summary["completed"] == 2 and summary["failed"] == 1 and summary["first_error"] == "HTTP 500: boom"
    assert summary["total_input_tokens"] == 17 and summary["total_output_tokens"] == 4
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx(2.0)
    assert summary["total_token_throughput"] == pytest.approx(10.5)
    assert summary["mean_ttft_ms"] == pytest.approx(200.0) and summary["p90_ttft_ms"] == pytest.approx(280.0)
    assert summary["mean_tpot_ms"] == pytest.approx(30.0)  # only the 3-token request: (160 - 100) / 2
    assert summary["mean_itl_ms"] == pytest.approx(30.0) and summary["p50_itl_ms"] == pytest.approx(30.0)
    assert summary["median_e2el_ms"] == pytest.approx(230.0)
    table = format_table(summary)
    for line in ("Successful requests:", "Failed requests:", "Median TTFT (ms):", "P99 ITL (ms):", "P90 E2EL"):
        assert line in table
    assert "P50 " not in table and "First error: HTTP 500: boom" in table
    with pytest.raises(ValueError, match="unknown metric"):
        summarize([ok], 1.0, metrics=["ttft", "nope"])


def test_request_bodies():
    config = ServeBenchConfig(extra_body={"top_k": 5})
    data = RandomDataset(4, 3, vocab_size=10)
    body = request_body(config, "m", data[0], ignore_eos=True)
    assert body["prompt"] == data[0].prompt and body["max_tokens"] == 3 and body["ignore_eos"] is True
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["return_token_ids"]
    assert body["top_k"] == 5 and body["temperature"] == 0.0
    chat = ServeBenchConfig(endpoint="/v1/chat/completions", return_token_ids=False)
    with pytest.raises(ValueError, match="text prompts"):
        request_body(chat, "m", data[0], ignore_eos=False)
    body = request_body(chat, "m", BenchRequest("hello", None, 2), False)
    assert body["messages"] == [{"role": "user", "content": "hello"}] and body["max_completion_tokens"] == 2
    assert "ignore_eos" not in body and "return_token_ids" not in body and "prompt" not in body


# ---------------------------------------------------------------------------------------------- scripted server
@dataclass
class Seen:
    """What the scripted server saw: the request bodies, and the most streams open at once."""

    bodies: list[dict] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter() when each request came in
    open: int = 0
    peak: int = 0


def scripted_app(
    *,
    usage: bool = True,
    token_ids: bool = True,
    fail: frozenset[int] = frozenset(),
    fail_mid: frozenset[int] = frozenset(),
    cut: frozenset[int] = frozenset(),
) -> tuple[web.Application, Seen]:
    """The scripted server and what it saw. Requests are counted from 1 (the warm-up); those in ``fail`` answer
    HTTP 500, those in ``fail_mid`` send an error event after the first token, those in ``cut`` end without
    ``[DONE]``."""
    app, seen = web.Application(), Seen()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}, {"id": "other"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.bodies.append(body)
        seen.times.append(time.perf_counter())
        if len(seen.bodies) in fail:
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        seen.open += 1
        seen.peak = max(seen.peak, seen.open)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            chat = "messages" in body
            empty = {"delta": {"role": "assistant", "content": ""}} if chat else {"text": ""}
            await sse_write(response, json.dumps({"choices": [{"index": 0, **empty}]}))
            await asyncio.sleep(FIRST_DELAY)
            total = body.get("max_tokens") or body.get("max_completion_tokens")
            sent = 0
            while sent < total:
                n = min(TOKENS_PER_CHUNK, total - sent)
                choice: dict = {"index": 0}
                choice.update({"delta": {"content": "ab" * n}} if chat else {"text": "ab" * n})
                if token_ids:
                    choice["token_ids"] = list(range(sent, sent + n))
                await sse_write(response, json.dumps({"choices": [choice]}))
                if len(seen.bodies) in fail_mid:
                    await sse_write(response, json.dumps({"error": {"message": "engine died", "code": 500}}))
                    return response
                sent += n
                if sent < total:
                    await asyncio.sleep(GAP)
            if usage and (body.get("stream_options") or {}).get("include_usage"):
                prompt = body.get("prompt")
                counts = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else 11, "completion_tokens": total}
                await sse_write(response, json.dumps({"choices": [], "usage": counts}))
            if len(seen.bodies) not in cut:
                await sse_write(response, "[DONE]")
            await response.write_eof()
            return response
        finally:
            seen.open -= 1

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    return app, seen


def _bench(url: str, **kwargs) -> dict:
    lines: list[str] = []
    result = bench_serve(ServeBenchConfig(base_url=url, **kwargs), log=lines.append)
    result["printed"] = "\n".join(lines)
    return result


@pytest.mark.parametrize("usage,token_ids", [(True, True), (False, True)])
def test_measured_figures_match_the_scripted_timing(usage, token_ids):
    app, seen = scripted_app(usage=usage, token_ids=token_ids)
    with serve_app(app) as url:
        result = _bench(url, num_prompts=3, random_input_len=12, random_output_len=6, vocab_size=100)
    assert result["completed"] == 3 and result["failed"] == 0 and result["model"] == "fake-model"
    assert result["output_lens"] == [6, 6, 6]  # 3 chunks of 2 tokens: from usage, else from token_ids
    for ttft in result["ttfts"]:  # the empty first chunk at t=0 does not count
        assert FIRST_DELAY <= ttft < FIRST_DELAY + SLACK
    gaps = [g for itl in result["itls"] for g in itl]
    # A loaded machine can deliver a chunk late and the next one on time, shortening that gap (by 15 ms seen).
    assert len(gaps) == 3 * 2 and all(GAP / 2 <= g < GAP + SLACK for g in gaps)
    for e2e in result["e2els"]:
        assert FIRST_DELAY + 2 * GAP <= e2e < FIRST_DELAY + 2 * GAP + 2 * SLACK
    # TPOT = (e2e - ttft) / (6 - 1) ≈ 2 gaps / 5 tokens = 40 ms (counting chunks instead of tokens would give 100)
    tpots = [(e2e - ttft) / 5 for e2e, ttft in zip(result["e2els"], result["ttfts"], strict=True)]
    assert result["mean_tpot_ms"] == pytest.approx(1000 * sum(tpots) / len(tpots))
    assert 1000 * GAP / 5 <= result["mean_tpot_ms"] < 1000 * (2 * GAP + SLACK) / 5
    assert result["total_input_tokens"] == 36 and result["total_output_tokens"] == 18
    assert result["output_throughput"] == pytest.approx(18 / result["duration"])
    bodies = seen.bodies
    assert len(bodies) == 4  # the warm-up, then three timed requests
    assert all(b["model"] == "fake-model" and b["ignore_eos"] is True and len(b["prompt"]) == 12 for b in bodies)
    assert bodies[0]["max_tokens"] == 6 and bodies[0]["prompt"] not in [b["prompt"] for b in bodies[1:]]
    assert "Serving Benchmark Result" in result["printed"] and "Mean TPOT (ms):" in result["printed"]


def test_chunks_are_counted_without_usage_or_token_ids():
    with serve_app(scripted_app(usage=False, token_ids=False)[0]) as url:
        result = _bench(url, num_prompts=2, random_input_len=4, random_output_len=4, return_token_ids=False)
    assert result["completed"] == 2 and result["output_lens"] == [2, 2]  # two chunks each: the best it can know


def test_chat_endpoint_with_a_text_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "write a poem", "max_tokens": 4}\n{"prompt": "and another"}\n')
    app, seen = scripted_app()
    with serve_app(app) as url:
        result = _bench(
            url, endpoint="/v1/chat/completions", dataset_path=str(path), random_output_len=2, num_prompts=2
        )
    assert result["completed"] == 2 and sorted(result["output_lens"]) == [2, 4]
    contents = [b["messages"][0]["content"] for b in seen.bodies]
    assert contents[0] == "write a poem" and sorted(contents[1:]) == ["and another", "write a poem"]
    assert all("ignore_eos" not in b for b in seen.bodies)  # a dataset's requests end where the model ends them


def test_failures_are_counted_not_raised():
    app, _ = scripted_app(fail=frozenset({2}), fail_mid=frozenset({4}), cut=frozenset({5}))  # 1 is the warm-up
    with serve_app(app) as url:
        result = _bench(url, num_prompts=5, random_input_len=4, random_output_len=2, max_concurrency=1)
    assert result["completed"] == 2 and result["failed"] == 3
    assert result["first_error"].startswith("HTTP 500") and "scripted failure" in result["first_error"]
    assert result["errors"][2] == "error event: engine died" and "before data: [DONE]" in result["errors"][3]
    assert "Failed requests:                         3" in result["printed"]


def test_concurrency_limit_and_duration():
    app, seen = scripted_app()
    with serve_app(app) as url:
        result = _bench(url, num_prompts=6, random_input_len=4, random_output_len=1, max_concurrency=2)
        assert result["completed"] == 6 and seen.peak == 2
        # ~0.2 s a request, two at a time, sending stops after 0.5 s: 3 rounds of 2 (the last starts at ~0.4 s)
        result = _bench(url, duration=0.5, random_input_len=4, random_output_len=1, max_concurrency=2)
    assert result["failed"] == 0 and 4 <= result["completed"] <= 6 and result["duration"] >= 0.5


def test_request_rate_spaces_the_sends():
    app, seen = scripted_app()
    with serve_app(app) as url:
        result = _bench(url, num_prompts=5, random_input_len=4, random_output_len=1, request_rate=10.0, seed=4)
    planned = arrival_times(5, 10.0, seed=4)
    sent = [t - seen.times[1] for t in seen.times[1:]]  # after the warm-up, from the first timed request
    assert result["completed"] == 5 and result["duration"] >= planned[-1] + FIRST_DELAY
    assert all(p - 0.005 <= s < p + 0.05 for p, s in zip(planned, sent)), (planned, sent)


def test_warm_up_failure_and_bad_flags_stop_the_run():
    from vllite.plugins.bench.serve import ServeBenchError

    app, _ = scripted_app(fail=frozenset({1}))
    with serve_app(app) as url, pytest.raises(ServeBenchError, match=r"warm-up request .* failed: HTTP 500"):
        _bench(url, num_prompts=1)
    with pytest.raises(ValueError, match="finite --request-rate or --max-concurrency"):
        _bench("http://127.0.0.1:9", duration=1.0)


def test_cli_saves_the_result(tmp_path, capsys):
    from vllite.cli import main

    with serve_app(scripted_app()[0]) as url:
        code = main([
            "bench", "serve", "--base-url", url, "--num-prompts", "2", "--random-input-len", "5",
            "--random-output-len", "2", "--save-result", "--result-dir", str(tmp_path), "--api-key", "secret",
            "--metric-percentiles", "90,99.9",
        ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "Successful requests:                     2" in out and "P99.9 TTFT (ms):" in out
    (path,) = tmp_path.glob("vllite-bench-serve-infqps-fake-model-*.json")
    saved = json.loads(path.read_text())
    assert saved["completed"] == 2 and saved["request_rate"] == "inf" and len(saved["ttfts"]) == 2
    assert "p99.9_ttft_ms" in saved and "secret" not in path.read_text()


def test_bench_command_does_not_load_the_client_at_start_up():
    code = (
        "import sys; from vllite.cli import build_parser; build_parser(); "
        "assert 'vllite.plugins.bench.serve' not in sys.modules; "
        "assert 'vllite.plugins.bench.serve_client' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------------- end to end
def test_bench_serve_and_agent_replay_against_vllite_serve():
    """The real server (demo model, continuum): a small load test and a tiny agent replay, every request served
    with exactly max_tokens tokens."""
    from vllite.plugins.bench.agent_bench import replay
    from vllite.plugins.bench.agent_http import HttpBackend
    from vllite.plugins.bench.traces import Job, Turn
    from vllite.plugins.openai_server.testing import RemoteServer

    args = ["--max-model-len", "256", "--scheduler-cls", "continuum", "--seed", "0"]
    with RemoteServer(args) as server:
        result = _bench(server.url, num_prompts=8, random_input_len=24, random_output_len=6, request_rate=50.0)
        assert result["completed"] == 8 and result["failed"] == 0, result["first_error"]
        assert result["output_lens"] == [6] * 8 and result["input_lens"] == [24] * 8
        assert all(t > 0 for t in result["ttfts"]) and result["mean_itl_ms"] > 0

        jobs = [Job("a", [Turn(20, 4, "ls", 0.5), Turn(6, 3)]), Job("b", [Turn(15, 5, "cat", 0.2), Turn(4, 2)])]
        backend = HttpBackend(server.url)
        served: dict[str, int] = {}
        step = backend.step

        def recording_step():
            events, progressed = step()
            served.update((request_id, len(tokens)) for request_id, tokens, _ in events)
            return events, progressed

        backend.step = recording_step  # type: ignore[method-assign]
        try:
            jct, _ = replay(jobs, [0.0, 0.0], backend, tool_time_scale=0.0)
            figures = backend.engine_figures()
        finally:
            backend.shutdown()
    assert len(jct) == 2
    assert served == {"a#0": 4, "a#1": 3, "b#0": 5, "b#1": 2}
    assert figures["prefix_hit_rate"] is not None and figures["prefix_hit_rate"] > 0  # turn 2 reuses turn 1's blocks
