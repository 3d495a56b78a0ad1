"""Agent-trace replay as sessions (``vllite bench agent --modes sessions``): each job one resumable request whose
turns are input chunks, against the same trace replayed as stateless requests, on the simulator and a real model."""

from __future__ import annotations

import json

import pytest

from vllite.plugins.bench.agent_report import BenchSettings, run_sweep, speedups
from vllite.plugins.bench.agent_sessions import SessionBook
from vllite.plugins.bench.errors import BenchReplayError
from vllite.plugins.bench.traces import Job, Turn, write_trace
from vllite.sampling_params import SamplingParams

# Three programs; the KV cache (24 blocks of 8 = 192 tokens) cannot hold all of them at once with their histories.
PROGRAMS = [
    Job("p0", [Turn(40, 6, "grep", 0.3), Turn(20, 5, "pytest", 0.6), Turn(10, 4)]),
    Job("p1", [Turn(60, 8, "cat", 0.1), Turn(12, 3, "sed", 0.2), Turn(9, 3)]),
    Job("p2", [Turn(30, 5, "ls", 0.2), Turn(25, 6, "ls", 0.3), Turn(8, 2)]),
]
#: Prompt tokens each turn adds (its new tokens), plus the last sampled token of the turn before it, which a
#: session prefills with the next chunk: the least any replay can compute.
NEW_TOKENS = sum(t.new_prompt_tokens for j in PROGRAMS for t in j.turns) + sum(len(j.turns) - 1 for j in PROGRAMS)
SIM = BenchSettings(
    num_gpu_blocks=24, block_size=8, max_num_batched_tokens=64, max_model_len=160, cost={"fixed_s": 0.01}
)


def by_mode(results):
    return {(r.scheduler, r.mode): r.summary() for r in results}


@pytest.mark.parametrize("scheduler", ["fcfs", "continuum"])
def test_sim_sessions_compute_fewer_prompt_tokens_and_complete_every_program(scheduler):
    results = run_sweep({"p": PROGRAMS}, [4.0], [scheduler], SIM, modes=["stateless", "sessions"], log=lambda _: None)
    rows = by_mode(results)
    stateless, sessions = rows[(scheduler, "stateless")], rows[(scheduler, "sessions")]
    assert stateless["completed"] == sessions["completed"] == len(PROGRAMS)
    assert NEW_TOKENS <= sessions["prompt_tokens_computed"] < stateless["prompt_tokens_computed"]
    assert sessions["tokens_scheduled"] < stateless["tokens_scheduled"]


def test_real_engine_sessions_compute_fewer_prompt_tokens_than_stateless():
    """The in-process engine through ``add_request(resumable=True)`` / ``add_session_input`` / ``close_session_input``;
    the backend checks each turn ran on the context the replay expected."""
    pytest.importorskip("torch")
    from vllite.testing import make_tiny_model_dir_cached

    model = make_tiny_model_dir_cached("llama")
    # Room for every program: in wall time the order of turns varies, and under memory pressure so do the releases;
    # with room, a stateless turn still recomputes its history's last partial block, a session's turn only its chunk.
    settings = BenchSettings(
        engine="real", model=str(model), num_gpu_blocks=64, block_size=8, max_model_len=160, tool_time_scale=0.1
    )
    results = run_sweep(
        {"p": PROGRAMS}, [20.0], ["fcfs", "continuum"], settings, modes=["stateless", "sessions"], log=lambda _: None
    )
    rows = by_mode(results)
    for scheduler in ("fcfs", "continuum"):
        stateless, sessions = rows[(scheduler, "stateless")], rows[(scheduler, "sessions")]
        assert stateless["completed"] == sessions["completed"] == len(PROGRAMS)
        assert NEW_TOKENS <= sessions["prompt_tokens_computed"] < stateless["prompt_tokens_computed"]
    ratios = {(s["scheduler"], s["mode"]): s["prompt_tokens_ratio"] for s in speedups(list(rows.values()))}
    assert set(ratios) == {("fcfs", "sessions"), ("continuum", "stateless"), ("continuum", "sessions")}
    assert 0 < ratios[("fcfs", "sessions")] < 1


def test_cli_modes_writes_both_modes(tmp_path, capsys):
    from vllite.cli import main

    trace = write_trace(tmp_path / "p.jsonl", PROGRAMS)
    code = main([
        "bench", "agent", "--trace", str(trace), "--jps", "4", "--schedulers", "fcfs", "--modes", "stateless,sessions",
        "--num-gpu-blocks", "24", "--block-size", "8", "--max-num-batched-tokens", "64", "--max-model-len", "160",
        "--cost", "0.01,0.0001,0", "--output-dir", str(tmp_path / "out"), "--no-plot",
    ])  # fmt: skip
    assert code == 0
    assert "fcfs+sessions: avg JCT" in capsys.readouterr().out
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["mode"], r["completed"]) for r in payload["rows"]] == [("stateless", 3), ("sessions", 3)]
    (speedup,) = payload["speedups"]
    assert speedup["mode"] == "sessions" and speedup["prompt_tokens_ratio"] < 1


def test_bad_modes_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--modes"):
        run_sweep({"p": PROGRAMS}, [4.0], ["fcfs"], SIM, modes=["stateful"], log=lambda _: None)
    server = BenchSettings(engine="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="--modes sessions"):
        run_sweep({"p": PROGRAMS}, [4.0], ["server"], server, modes=["sessions"], log=lambda _: None)


def test_session_book_sends_only_what_a_turn_adds_and_refuses_a_diverging_prompt():
    book = SessionBook()
    first = SamplingParams(max_tokens=2, extra_args={"job_id": "j", "is_last_step": False})
    last = SamplingParams(max_tokens=2, extra_args={"job_id": "j", "is_last_step": True})
    assert book.chunk("j#0", [1, 2, 3], first) == ("j", [1, 2, 3], True, False)
    book.running("j").turn_tokens = [7, 8]
    assert book.end_turn("j") == "j#0"
    with pytest.raises(BenchReplayError, match="does not extend"):
        book.chunk("j#1", [1, 2, 3, 9, 9, 4], last)
    assert book.chunk("j#1", [1, 2, 3, 7, 8, 4, 5], last) == ("j", [4, 5], False, True)
    assert book.end_turn("j") == "j#1" and "j" not in book.sessions
