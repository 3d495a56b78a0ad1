"""``vllite bench agent --engine http://...``: the agent-trace replay against a live server (HttpBackend), checked
against a scripted server that records what it receives."""

from __future__ import annotations

import asyncio
import csv
import json
import threading
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from tests.fake_openai import serve_app
from vllite.plugins.bench.agent_bench import new_prompt_tokens, replay, turn_params
from vllite.plugins.bench.agent_http import HttpBackend, parse_prometheus, request_body
from vllite.plugins.bench.agent_report import BenchSettings, run_sweep, write_report
from vllite.plugins.bench.errors import BenchReplayError
from vllite.plugins.bench.traces import Job, Turn, write_trace

JOBS = [
    Job("j0", [Turn(12, 3, "grep", 0.3), Turn(5, 2, "pytest", 0.2), Turn(4, 4)]),
    Job("j1", [Turn(9, 2, "cat", 0.1), Turn(6, 1)]),
    Job("j2", [Turn(7, 5)]),
]
REPLY_S = 0.05  # each turn takes this long at the scripted server


@dataclass
class Seen:
    """What the scripted server saw and counted (its /metrics counters)."""

    bodies: list[dict] = field(default_factory=list)
    queries: int = 0
    hits: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def scripted_app(
    *, metrics: bool = True, fail_job: str | None = None, max_model_len: int = 1024
) -> tuple[web.Application, Seen]:
    """Answers each turn after REPLY_S with ``max_tokens`` token ids 100, 101, ...; counts every prompt token as a
    prefix-cache query and half of them (rounded down) as hits."""
    app, seen = web.Application(), Seen()

    async def models(request: web.Request) -> web.Response:
        card = {"id": "fake-model", "object": "model", "max_model_len": max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        with seen.lock:
            seen.bodies.append(body)
            seen.queries += len(body["prompt"])
            seen.hits += len(body["prompt"]) // 2
        await asyncio.sleep(REPLY_S)
        if fail_job is not None and body.get("job_id") == fail_job:
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        tokens = list(range(100, 100 + body["max_tokens"]))
        choice = {"index": 0, "text": "x", "finish_reason": "length", "token_ids": tokens}
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(tokens)}
        return web.json_response({"id": "cmpl-1", "choices": [choice], "usage": usage})

    async def metrics_page(request: web.Request) -> web.Response:
        text = (
            "# HELP vllm:prefix_cache_queries_total Prefix-cache queries.\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f'vllm:prefix_cache_queries_total{{model_name="fake-model"}} {float(seen.queries)}\n'
            f'vllm:prefix_cache_hits_total{{model_name="fake-model"}} {float(seen.hits)}\n'
            'vllm:prefix_cache_hits_created{model_name="fake-model"} 1.7e9\n'
            'vllm:num_preemptions_total{model_name="fake-model"} 0.0\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="321"} 1.0\n'
        )
        return web.Response(text=text)

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    if metrics:
        app.router.add_get("/metrics", metrics_page)
    return app, seen


def test_parse_prometheus():
    text = (
        '# HELP x\nvllm:prefix_cache_hits_total{a="1"} 3.0\nvllm:prefix_cache_hits_total{a="2"} 4\n'
        "vllite:num_preemptions_total 2\nplain_gauge 1.5\nbroken_line nan_or_what\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="77"} 1\n'
    )
    values = parse_prometheus(text)
    assert values["prefix_cache_hits"] == 7.0 and values["num_preemptions"] == 2.0 and values["plain_gauge"] == 1.5
    assert values["num_gpu_blocks"] == 77.0 and "broken_line" not in values


def test_turn_body_carries_the_continuum_fields_at_top_level():
    body = request_body("m", [1, 2, 3], turn_params(JOBS[0], 0))
    assert body == {
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True, "job_id": "j0", "is_last_step": False, "this_func_call": "grep",
    }  # fmt: skip
    last = request_body("m", [1], turn_params(JOBS[0], 2))
    assert last["is_last_step"] is True and "this_func_call" not in last


def test_replay_over_http_builds_prompts_from_the_served_outputs():
    app, seen = scripted_app()
    with serve_app(app) as url:
        backend = HttpBackend(url, vocab_size=50)
        try:
            assert backend.model == "fake-model" and backend.max_model_len == 1024 and backend.num_gpu_blocks == 321
            jct, makespan = replay(JOBS, [0.0, 0.05, 0.1], backend, tool_time_scale=0.5, seed=3)
            figures = backend.engine_figures()
        finally:
            backend.shutdown()
    assert not backend._thread.is_alive()
    assert len(jct) == 3
    # j0: three turns of ~REPLY_S each and two tool calls of 0.15 + 0.1 s
    assert 3 * REPLY_S + 0.25 <= jct[0] < 3 * REPLY_S + 0.25 + 0.3
    assert makespan == pytest.approx(max(jct), abs=0.05)
    turns = [b for b in seen.bodies[1:] if b["job_id"] == "j0"]  # bodies[0] is the warm-up
    assert [b["is_last_step"] for b in turns] == [False, False, True]
    assert [b.get("this_func_call") for b in turns] == ["grep", "pytest", None]
    expected = new_prompt_tokens("j0", 0, 12, 50, 3)
    assert turns[0]["prompt"] == expected
    expected = [*expected, 100, 101, 102, *new_prompt_tokens("j0", 1, 5, 50, 3)]
    assert turns[1]["prompt"] == expected
    assert turns[2]["prompt"] == [*expected, 100, 101, *new_prompt_tokens("j0", 2, 4, 50, 3)]
    assert all(b["ignore_eos"] and b["temperature"] == 0.0 and b["return_token_ids"] for b in seen.bodies[1:])
    timed = seen.bodies[1:]
    queries = sum(len(b["prompt"]) for b in timed)
    assert figures["prefix_hit_rate"] == pytest.approx(sum(len(b["prompt"]) // 2 for b in timed) / queries)
    assert figures["preemptions"] == 0 and figures["sched_ms_per_step"] is None and figures["steps"] is None


def test_sweep_and_report_leave_unseen_figures_absent(tmp_path):
    app, _ = scripted_app(metrics=False)
    with serve_app(app) as url:
        settings = BenchSettings(engine=url, tool_time_scale=0.0, vocab_size=50, api_key="secret")
        (result,) = run_sweep({"tiny": JOBS}, [20.0], ["continuum"], settings, log=lambda _: None)
        with pytest.raises(ValueError, match="one --schedulers label"):
            run_sweep({"tiny": JOBS}, [20.0], ["fcfs", "continuum"], settings)
    row = result.summary()
    assert row["completed"] == 3 and row["scheduler"] == "continuum"
    for key in ("prefix_hit_rate", "preemptions", "steps", "sched_ms_per_step", "sched_cpu_ms_per_step"):
        assert row[key] is None, key
    assert row["num_gpu_blocks"] is None
    paths = write_report([result], str(tmp_path), settings=settings, plot=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"][0]["prefix_hit_rate"] is None and "secret" not in (tmp_path / "results.json").read_text()
    with open(paths["csv"], newline="") as f:
        assert next(csv.DictReader(f))["sched_ms_per_step"] == ""


def test_a_failed_turn_stops_the_replay_with_the_server_answer():
    app, _ = scripted_app(fail_job="j1")
    with serve_app(app) as url:
        backend = HttpBackend(url, vocab_size=50)
        try:
            with pytest.raises(BenchReplayError, match=r"j1#0 .* failed: HTTP 500.*scripted failure"):
                replay(JOBS, [0.0, 0.0, 0.0], backend, tool_time_scale=0.0)
        finally:
            backend.shutdown()


def test_a_trace_longer_than_the_served_context_is_refused():
    app, _ = scripted_app(max_model_len=16)
    with serve_app(app) as url, pytest.raises(ValueError, match="needs 30 tokens of context"):
        run_sweep({"tiny": JOBS}, [1.0], ["x"], BenchSettings(engine=url), log=lambda _: None)


def test_cli_bench_agent_over_http(tmp_path, capsys):
    from vllite.cli import main

    trace = write_trace(tmp_path / "tiny.jsonl", JOBS)
    app, seen = scripted_app()
    with serve_app(app) as url:
        base = ["bench", "agent", "--engine", url, "--trace", str(trace), "--jps", "10", "--tool-time-scale", "0"]
        code = main([*base, "--vocab-size", "50", "--output-dir", str(tmp_path / "out"), "--no-plot"])
        assert code == 0
        assert main([*base, "--schedulers", "fcfs,continuum"]) == 2
    out = capsys.readouterr()
    assert "server: avg JCT" in out.out and "sched n/a ms/step" in out.out
    assert "one --schedulers label" in out.err
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert rows[0]["completed"] == 3 and rows[0]["scheduler"] == "server" and rows[0]["num_gpu_blocks"] == 321
    # new prompt tokens come from --vocab-size 50; the served outputs (100, 101, ...) re-enter the history
    assert all(t < 50 or t >= 100 for b in seen.bodies[1:] for t in b["prompt"])
    with pytest.raises(SystemExit):
        main(["bench", "agent", "--engine", "ftp://nowhere"])
