"""Data-parallel failures (model-free engines): one of two engines SIGKILLed mid-load — its requests fail with
``EngineDeadError`` within 5 s, the other's all complete, new work goes to the survivor, then with none left every
call fails fast — an engine that fails to start (one clear error, nothing left running), and ``AsyncLLM`` streams
on a dead engine raising ``EngineDeadError`` while the others finish."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from tests.test_engine_proc import Collector, expected_tokens, make_config, request
from vllite.exceptions import EngineDeadError, EngineStartupError
from vllite.protocol import FinishReason

pytestmark = pytest.mark.skipif(os.environ.get("VLLITE_SKIP_MP_TESTS") == "1", reason="multiprocess tests disabled")


def _dp_client(**kwargs: Any) -> Any:
    from vllite.plugins.engine_proc.dp_client import SyncDPClient

    return SyncDPClient(make_config(data_parallel_size=2, **kwargs))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_killing_one_engine_fails_its_requests_and_the_other_serves_on():
    client = _dp_client(step_delay_s=0.01, max_num_seqs=64)
    pids = [engine.resources.proc.pid for engine in client.engines]
    ipc_dirs = [engine.resources.endpoints.ipc_dir for engine in client.engines]
    try:
        col = Collector(client)
        for i in range(40):
            client.add_request(request(f"r{i}", max_tokens=60))
        owners = {f"r{i}": client.router.owner(f"r{i}") for i in range(40)}
        assert set(owners.values()) == {0, 1}
        col.until(lambda: sum(len(t) for t in col.tokens.values()) >= 40)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        doomed = [r for r, e in owners.items() if e == 1]
        col.until(lambda: all(r in col.finish for r in doomed), timeout=5)
        assert time.monotonic() - killed_at < 5
        assert all(col.finish[r] == FinishReason.ERROR and "EngineDeadError" in col.errors[r] for r in doomed)
        assert all("engine core 1 died" in col.errors[r] for r in doomed)
        assert client.dead_engines == {1} and not client.is_engine_dead
        # New work goes to the survivor; the survivor's requests all complete.
        for i in range(5):
            client.add_request(request(f"after{i}", max_tokens=5))
        survivors = [r for r, e in owners.items() if e == 0] + [f"after{i}" for i in range(5)]
        col.until_finished(*survivors)
        assert all(col.finish[r] == FinishReason.LENGTH for r in survivors)
        assert all(col.tokens[r] == expected_tokens(4, 60) for r in survivors if r.startswith("r"))
        assert client.call_utility("get_num_unfinished_requests") == 0  # fan-out skips the dead engine
        # The last engine dies too: everything fails fast.
        client.add_request(request("last", max_tokens=10_000))
        col.until_tokens("last")
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="Every data-parallel engine core is dead"):
            col.until(lambda: False, timeout=5)
        assert col.finish["last"] == FinishReason.ERROR
        assert client.is_engine_dead
        with pytest.raises(EngineDeadError):
            client.add_request(request("none"))
        with pytest.raises(EngineDeadError):
            client.call_utility("is_sleeping")
    finally:
        client.shutdown()
    assert all(_gone(pid) for pid in pids)
    assert not any(os.path.exists(d) for d in ipc_dirs)


def test_an_engine_that_fails_to_start_is_one_clear_error_and_nothing_is_left(monkeypatch):
    import multiprocessing

    # Engine 1 is given a CPU outside the affinity mask: its start-up fails, engine 0's succeeds.
    monkeypatch.setenv("VLLITE_CPU_OMP_THREADS_BIND", f"{min(os.sched_getaffinity(0))}|4095")
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(EngineStartupError, match=r"Data-parallel engine core 1 \(of 2\) failed to start.*4095"):
        _dp_client()
    left = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert left == []


def test_async_llm_streams_on_a_killed_engine_raise_engine_dead():
    from vllite.plugins.engine_proc.async_llm import AsyncLLM
    from vllite.sampling_params import RequestOutputKind, SamplingParams

    llm = AsyncLLM(config=make_config(step_delay_s=0.01, data_parallel_size=2))
    params = SamplingParams(max_tokens=80, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def one(i: int) -> str:
        try:
            count = 0
            async for out in llm.generate(
                {"prompt_token_ids": [1, 2, 3, 4]}, params, f"a{i}", data_parallel_rank=i % 2
            ):
                count += len(out.outputs[0].token_ids)
                if i == 1 and count >= 3:
                    os.kill(llm.engine_core.engines[1].resources.proc.pid, signal.SIGKILL)
            return f"done:{count}"
        except EngineDeadError as exc:
            return f"dead:{exc}"

    async def main() -> list[str]:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), timeout=30)

    try:
        results = asyncio.run(main())
    finally:
        llm.shutdown()
    assert results[0::2] == ["done:80"] * 3
    assert all(r.startswith("dead:") and "engine core 1 died" in r for r in results[1::2])


def test_dp_retry_continues_a_dead_engines_requests_on_the_live_one():
    client = _dp_client(step_delay_s=0.01, max_num_seqs=64, dp_retry=True)
    pids = [engine.resources.proc.pid for engine in client.engines]
    try:
        col = Collector(client)
        for i in range(30):
            client.add_request(request(f"r{i}", max_tokens=60))
        client.add_request(request("pinned", max_tokens=60, extra_args={"data_parallel_rank": 1}))
        owners = {f"r{i}": client.router.owner(f"r{i}") for i in range(30)}
        moved = [r for r, e in owners.items() if e == 1]
        col.until(lambda: all(len(col.tokens.get(r, [])) >= 3 for r in moved))
        os.kill(pids[1], signal.SIGKILL)
        col.until_finished(*owners, "pinned")
        # The fake model's token is 1000 + its position, so a continuation that lost or repeated a token shows.
        assert all(col.finish[r] == FinishReason.LENGTH and col.tokens[r] == expected_tokens(4, 60) for r in owners)
        assert all(client.router.owner(r) is None for r in owners)
        # A request that names the dead engine's rank cannot continue elsewhere.
        assert col.finish["pinned"] == FinishReason.ERROR and "engine core 1 died" in col.errors["pinned"]
        assert client.dead_engines == {1}
    finally:
        client.shutdown()
    assert all(_gone(pid) for pid in pids)


def test_dp_retry_through_async_llm_streams_without_a_gap():
    from vllite.plugins.engine_proc.async_llm import AsyncLLM
    from vllite.sampling_params import RequestOutputKind, SamplingParams

    llm = AsyncLLM(config=make_config(step_delay_s=0.01, data_parallel_size=2, dp_retry=True))
    params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA)

    killed: list[int] = []

    async def one(i: int) -> list[int]:
        tokens: list[int] = []
        async for out in llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, f"a{i}"):
            tokens.extend(out.outputs[0].token_ids)
            if i == 1 and len(tokens) >= 5 and not killed:
                owned = llm.engine_core.router.group_by_owner(llm.output_processor.request_states)
                killed.append(next(engine for engine, ids in owned.items() if any(r.startswith("a1-") for r in ids)))
                os.kill(llm.engine_core.engines[killed[0]].resources.proc.pid, signal.SIGKILL)
        return tokens

    async def main() -> list[list[int]]:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), timeout=30)

    try:
        results = asyncio.run(main())
        assert llm.engine_core.dead_engines == set(killed)
    finally:
        llm.shutdown()
    assert results == [expected_tokens(4, 50)] * 6


def test_dp_retry_and_lockstep_are_refused_together():
    with pytest.raises(ValueError, match="dp_retry cannot be combined with dp_lockstep"):
        make_config(data_parallel_size=2, dp_retry=True, dp_lockstep=True)
