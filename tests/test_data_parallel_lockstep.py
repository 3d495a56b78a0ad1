"""Lockstep data parallel (``--dp-lockstep``), model-free engines: a request for one engine while the others idle
starts a wave on all of them (its engine's all-reduces need them: without the wave it would hang), waves end and
restart, engines pause and resume together, and a 2,000-request random fuzz with aborts strands nothing."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest

from tests.test_engine_proc import Collector, expected_tokens, make_config, request
from vllite.protocol import FinishReason

pytestmark = pytest.mark.skipif(os.environ.get("VLLITE_SKIP_MP_TESTS") == "1", reason="multiprocess tests disabled")


@pytest.fixture(scope="module")
def client():
    from vllite.plugins.engine_proc.dp_client import SyncDPClient

    # 3 ms steps: the pause test must reach its requests before they finish 200 tokens, however slow the machine.
    c = SyncDPClient(make_config(step_delay_s=0.003, data_parallel_size=2, dp_lockstep=True, max_num_seqs=32))
    yield c
    c.shutdown()


def _on(engine: int, request_id: str, **kwargs: Any):
    r = request(request_id, **kwargs)
    r.data_parallel_rank = engine
    return r


def _wait_idle(client: Any, col: Collector, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while client.waves.engines_running:
        assert time.monotonic() < deadline, f"the wave never ended: {client.waves} {client.router.engines}"
        if not client.outputs_queue.empty():
            col.pump()
        time.sleep(0.01)


def _drain(client: Any, col: Collector, quiet_s: float = 0.3) -> None:
    """Takes every output that arrives until none has for ``quiet_s``."""
    last = time.monotonic()
    while time.monotonic() - last < quiet_s:
        if client.outputs_queue.empty():
            time.sleep(0.01)
        else:
            col.pump()
            last = time.monotonic()


def test_a_request_for_one_engine_starts_a_wave_on_all(client):
    col = Collector(client)
    _wait_idle(client, col)
    completed = client.waves.waves_completed
    # 100 steps on engine 1: three all-reduces, each needing engine 0, which has no request of its own.
    client.add_request(_on(1, "solo", max_tokens=100))
    col.until_finished("solo")
    assert col.tokens["solo"] == expected_tokens(4, 100)
    _wait_idle(client, col)
    assert client.waves.waves_completed == completed + 1
    # And again on the other engine: a new wave.
    client.add_request(_on(0, "solo2", max_tokens=70))
    col.until_finished("solo2")
    _wait_idle(client, col)
    assert client.waves.waves_completed == completed + 2


def test_engines_pause_and_resume_together(client):
    col = Collector(client)
    for i in range(6):
        client.add_request(_on(i % 2, f"p{i}", max_tokens=200))
    col.until(lambda: all(len(col.tokens.get(f"p{i}", ())) >= 2 for i in range(6)))
    client.call_utility("pause_scheduler", "keep")
    try:
        assert client.call_utility("is_scheduler_paused") is True
        _wait_idle(client, col)  # every engine paused: the wave ends although requests are kept
        _drain(client, col)
        frozen = {i: len(col.tokens[f"p{i}"]) for i in range(6)}
        _drain(client, col)
        assert {i: len(col.tokens[f"p{i}"]) for i in range(6)} == frozen
        assert all(n < 200 for n in frozen.values())
    finally:
        client.call_utility("resume_scheduler")  # a failure here must not leave the module's engines paused
    col.until_finished(*(f"p{i}" for i in range(6)))
    assert all(col.tokens[f"p{i}"] == expected_tokens(4, 200) for i in range(6))


def test_random_fuzz_with_aborts_strands_nothing(client):
    rng = random.Random(18)
    col = Collector(client)
    aborted: set[str] = set()
    sent: list[str] = []
    for i in range(2000):
        request_id = f"f{i}"
        kwargs = {"max_tokens": rng.randint(1, 40), "prompt_len": rng.randint(1, 12)}
        r = _on(rng.randrange(2), request_id, **kwargs) if rng.random() < 0.5 else request(request_id, **kwargs)
        client.add_request(r)
        sent.append(request_id)
        if rng.random() < 0.1:
            victim = rng.choice(sent[-20:])
            client.abort_requests([victim])
            aborted.add(victim)
        if rng.random() < 0.05:  # let waves end now and then, so requests cross a wave's end
            _wait_idle(client, col)
        while not client.outputs_queue.empty():
            col.pump()
    unaborted = [r for r in sent if r not in aborted]
    col.until(lambda: all(r in col.finish for r in unaborted), timeout=120)
    assert all(col.finish[r] in (FinishReason.LENGTH, FinishReason.ABORT) for r in unaborted)
    assert all(col.finish[r] == FinishReason.LENGTH for r in unaborted if r not in aborted)
    _wait_idle(client, col)
    assert client.call_utility("get_num_unfinished_requests") == 0
    assert client.waves.waves_completed > 10
