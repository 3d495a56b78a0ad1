"""Agent-trace replay: trace format, synthetic statistics, Poisson arrivals, replays on the sim and a real model."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from vllite.plugins.bench.agent_bench import SimBackend, replay, turn_params
from vllite.plugins.bench.agent_report import (
    BenchSettings,
    make_sim_config,
    percentile,
    run_sweep,
    speedups,
    write_report,
)
from vllite.plugins.bench.traces import (
    PRESETS,
    Job,
    Turn,
    generate_trace,
    poisson_arrivals,
    read_trace,
    trace_stats,
    write_trace,
)

# Small and fast: short prompts, instant-ish tools, a KV cache that forces contention.
TINY = [
    Job("j0", [Turn(40, 6, "grep", 0.5), Turn(20, 5, "pytest", 2.0), Turn(10, 4)]),
    Job("j1", [Turn(60, 8, "cat", 0.1), Turn(12, 3)]),
    Job("j2", [Turn(30, 5, "ls", 0.2), Turn(25, 6, "ls", 0.3), Turn(8, 2)]),
    Job("j3", [Turn(50, 4)]),
]
TINY_SETTINGS = BenchSettings(num_gpu_blocks=24, block_size=8, max_num_batched_tokens=64, max_model_len=128)


def test_trace_round_trip_and_bad_records(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [*TINY, Job("j9", [Turn(5, 1)], arrival_s=3.5)])
    loaded = read_trace(path)
    assert [j.to_dict() for j in loaded] == [j.to_dict() for j in [*TINY, Job("j9", [Turn(5, 1)], 3.5)]]
    assert loaded[0].prompt_len(2) == 40 + 6 + 20 + 5 + 10
    assert loaded[0].total_tokens == 46 + (46 + 25) + (71 + 14)
    path.write_text('# a comment\n{"job_id": "x", "turns": [{"new_prompt_tokens": 0, "output_tokens": 3}]}\n')
    with pytest.raises(ValueError, match=":2: bad job record"):
        read_trace(path)


@pytest.mark.parametrize("name", ["swe", "bfcl"])
def test_synthetic_traces_match_table_2(name):
    stats = trace_stats(generate_trace(name, 4000, seed=3))
    targets = PRESETS[name].targets
    for key in ("turns_mean", "tool_ms_mean", "tokens_mean"):
        assert stats[key] == pytest.approx(targets[key], rel=0.08), key
    for key in ("turns_std", "tool_ms_std", "tokens_std"):
        assert stats[key] == pytest.approx(targets[key], rel=0.2), key
    assert stats["max_context"] <= PRESETS[name].max_context
    assert generate_trace(name, 5, seed=3)[0].to_dict() == generate_trace(name, 5, seed=3)[0].to_dict()


def test_token_scale_shrinks_lengths_and_context_but_keeps_turns_and_tools():
    full, tiny = generate_trace("swe", 50, seed=1), generate_trace("swe", 50, seed=1, token_scale=0.03)
    assert max(job.max_context for job in tiny) <= int(PRESETS["swe"].max_context * 0.03)
    assert trace_stats(tiny)["tokens_mean"] < trace_stats(full)["tokens_mean"] / 20
    assert [t.tool for t in tiny[0].turns][:3] == [t.tool for t in full[0].turns][:3]
    with pytest.raises(ValueError):
        generate_trace("swe", 1, token_scale=0)


def test_last_turn_calls_no_tool_and_others_do():
    for job in generate_trace("swe", 50, seed=1):
        assert job.turns[-1].tool is None and job.turns[-1].tool_duration_s == 0.0
        assert all(t.tool is not None for t in job.turns[:-1])


def test_poisson_arrivals_rate():
    times = poisson_arrivals(5000, 0.5, seed=2)
    assert times[0] == 0.0 and times == sorted(times)
    assert (len(times) - 1) / times[-1] == pytest.approx(0.5, rel=0.05)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


def test_percentile_and_turn_params():
    assert percentile([], 90) == 0.0
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([0, 10], 90) == pytest.approx(9.0)
    params = turn_params(TINY[0], 0)
    assert params.max_tokens == 6 and params.ignore_eos
    assert params.extra_args == {"job_id": "j0", "is_last_step": False, "this_func_call": "grep"}
    assert turn_params(TINY[0], 2).extra_args == {"job_id": "j0", "is_last_step": True}


def test_replay_builds_prompts_from_the_history_and_waits_for_tools():
    backend = SimBackend(make_sim_config(TINY_SETTINGS, "fcfs", max_context=256))
    submitted: list[tuple[str, list[int], float]] = []
    original = backend.submit

    def spy(request_id, prompt, params):
        submitted.append((request_id, list(prompt), backend.now()))
        original(request_id, prompt, params)

    backend.submit = spy  # type: ignore[method-assign]
    jct, makespan = replay(TINY[:1], [1.0], backend)
    backend.shutdown()
    (id0, p0, t0), (id1, p1, t1), (id2, p2, t2) = submitted
    assert (id0, id1, id2) == ("j0#0", "j0#1", "j0#2")
    assert t0 == 1.0
    assert len(p0) == 40 and len(p1) == 40 + 6 + 20 and len(p2) == 66 + 5 + 10
    assert p1[:40] == p0 and p2[: len(p1)] == p1  # each prompt extends the previous prompt + output
    assert t1 >= t0 + 0.5 and t2 >= t1 + 2.0  # next turns arrive only after the tool calls
    assert jct == [pytest.approx(makespan)] and jct[0] > 2.5


@pytest.mark.parametrize("scheduler", ["fcfs", "continuum"])
def test_replay_completes_every_job(scheduler):
    (result,) = run_sweep({"tiny": TINY}, [2.0], [scheduler], TINY_SETTINGS, log=lambda _: None)
    row = result.summary()
    assert row["completed"] == len(TINY) and row["scheduler"] == scheduler
    assert row["avg_jct_s"] > 0 and row["p95_jct_s"] >= row["p90_jct_s"] >= row["p50_jct_s"]
    assert row["steps"] > 0 and row["sched_ms_per_step"] > 0
    assert 0.0 < row["prefix_hit_rate"] < 1.0  # later turns hit their job's history
    assert row["num_gpu_blocks"] == 24


def test_sweep_writes_the_report(tmp_path):
    results = run_sweep({"tiny": TINY}, [1.0, 4.0], ["fcfs", "continuum"], TINY_SETTINGS, log=lambda _: None)
    paths = write_report(results, str(tmp_path), settings=TINY_SETTINGS, plot=False)
    payload = json.loads((tmp_path / "results.json").read_text())
    assert len(payload["rows"]) == 4 and payload["settings"]["num_gpu_blocks"] == 24
    assert {(s["jps"], s["scheduler"]) for s in payload["speedups"]} == {(1.0, "continuum"), (4.0, "continuum")}
    with open(paths["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["scheduler"] for r in rows] == ["fcfs", "continuum", "fcfs", "continuum"]
    assert all(int(r["completed"]) == len(TINY) for r in rows)


def test_plot_is_written_when_matplotlib_is_present(tmp_path):
    pytest.importorskip("matplotlib")
    results = run_sweep({"tiny": TINY[:2]}, [1.0], ["fcfs"], TINY_SETTINGS, log=lambda _: None)
    paths = write_report(results, str(tmp_path), plot=True)
    assert (tmp_path / "jct_vs_load.png").read_bytes()[:4] == b"\x89PNG" and "plot" in paths


def test_speedups_compare_against_fcfs():
    rows = [
        {"workload": "w", "jps": 1.0, "scheduler": "fcfs", "avg_jct_s": 30.0, "sched_ms_per_step": 1.0,
         "sched_cpu_ms_per_step": 1.0},
        {"workload": "w", "jps": 1.0, "scheduler": "continuum", "avg_jct_s": 10.0, "sched_ms_per_step": 1.1,
         "sched_cpu_ms_per_step": 0.9},
    ]  # fmt: skip
    (row,) = speedups(rows)
    assert row["jct_speedup"] == pytest.approx(3.0) and row["sched_time_ratio"] == pytest.approx(1.1)


def test_cli_bench_agent(tmp_path, capsys):
    from vllite.cli import main

    trace = write_trace(tmp_path / "tiny.jsonl", TINY)
    code = main([
        "bench", "agent", "--trace", str(trace), "--jps", "2", "--schedulers", "fcfs,continuum",
        "--num-gpu-blocks", "24", "--block-size", "8", "--max-num-batched-tokens", "64", "--max-model-len", "128",
        "--cost", "0.01,0.0001,0", "--output-dir", str(tmp_path / "out"), "--no-plot",
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "continuum: avg JCT" in out and "lower than fcfs" in out
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert [r["completed"] for r in rows] == [4, 4]


def test_real_engine_replay_of_a_tiny_trace(tmp_path):
    pytest.importorskip("torch")
    from vllite.testing import make_tiny_model_dir_cached

    model = make_tiny_model_dir_cached("llama")
    settings = BenchSettings(
        engine="real", model=str(model), num_gpu_blocks=64, block_size=8, max_model_len=256, tool_time_scale=0.0
    )
    jobs = [Job("r0", [Turn(20, 3, "ls", 0.5), Turn(6, 2)]), Job("r1", [Turn(16, 2)])]
    results = run_sweep({"tiny": jobs}, [100.0], ["fcfs", "continuum"], settings, log=lambda _: None)
    assert [r.summary()["completed"] for r in results] == [2, 2]
    assert results[0].prefix_hit_rate > 0  # the second turn of r0 reuses the first turn's blocks
    paths = write_report(results, str(tmp_path), plot=False)
    assert "profile" in paths  # measured step times, to fit the simulator's cost model
    lines = Path(paths["profile"]).read_text().splitlines()
    assert lines and all(json.loads(line)["seconds"] > 0 for line in lines)


def test_agent_bench_still_serves_the_report_names_with_a_warning():
    from vllite.plugins.bench import agent_bench, agent_report

    with pytest.warns(DeprecationWarning, match="import it from vllite.plugins.bench.agent_report"):
        assert agent_bench.run_sweep is agent_report.run_sweep
    with pytest.raises(AttributeError):
        agent_bench.no_such_name  # noqa: B018
