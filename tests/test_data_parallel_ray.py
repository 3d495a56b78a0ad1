"""Data parallel on Ray (``--data-parallel-backend ray``) against a real two-node Ray cluster started here
(``ray.cluster_utils.Cluster``, one CPU per node): the engines are actors on both nodes; greedy outputs equal
``-dp 1`` and Hugging Face; one actor killed mid-load fails its requests within 5 s while the other's complete;
shutdown leaves no actor, actor process or placement group. Skipped only where Ray is not installed."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from tests.test_data_parallel import ENGINE_KWARGS, MAX_TOKENS, _greedy  # noqa: E402
from tests.test_data_parallel import case as case  # noqa: E402  (the module fixture)
from tests.test_engine_proc import Collector, expected_tokens, make_config, request  # noqa: E402
from vllite.exceptions import EngineDeadError  # noqa: E402
from vllite.protocol import FinishReason  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("VLLITE_SKIP_MP_TESTS") == "1", reason="multiprocess tests disabled")


#: Ray's memory monitor kills workers when the machine's memory runs high, whoever uses it: off on a shared test
#: machine (the tests kill actors themselves). Ray's variable names are case-sensitive.
RAY_MEMORY_MONITOR = "RAY_memory_monitor_refresh_ms"


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RAY_MEMORY_MONITOR, "0")
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        nodes.add_node(num_cpus=1)
        ray.init(address=nodes.address, log_to_driver=False)
        yield nodes
        ray.shutdown()
        nodes.shutdown()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _assert_nothing_left(client: Any, pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, "an engine actor's process survived the shutdown"
        time.sleep(0.1)
    assert client.placement_group is None
    states = {entry["state"] for entry in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}, states


def test_llm_dp2_on_ray_equals_hf_with_actors_on_both_nodes(cluster, case, monkeypatch):
    from vllite import LLM

    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")
    model_dir, prompts, expected = case
    llm = LLM(model_dir, data_parallel_size=2, data_parallel_backend="ray", **ENGINE_KWARGS)
    client: Any = llm.llm_engine.engine_core
    try:
        assert type(client).__name__ == "SyncRayDPClient"
        assert len({engine.node_id for engine in client.engines}) == 2  # one actor per node
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
        assert llm.reset_prefix_cache() is True
        pids = [engine.resources.proc.pid for engine in client.engines]
    finally:
        llm.shutdown()
    _assert_nothing_left(client, pids)


def test_killing_one_actor_fails_its_requests_and_the_other_serves_on(cluster):
    from vllite.plugins.ray_dp.client import SyncRayDPClient

    client = SyncRayDPClient(make_config(data_parallel_size=2, data_parallel_backend="ray", step_delay_s=0.01))
    pids = [engine.resources.proc.pid for engine in client.engines]
    try:
        col = Collector(client)
        for i in range(20):
            client.add_request(request(f"r{i}", max_tokens=60))
        owners = {f"r{i}": client.router.owner(f"r{i}") for i in range(20)}
        assert set(owners.values()) == {0, 1}
        col.until(lambda: sum(len(t) for t in col.tokens.values()) >= 20)
        killed_at = time.monotonic()
        ray.kill(client.engines[1].resources.proc.actor, no_restart=True)
        doomed = [r for r, e in owners.items() if e == 1]
        col.until(lambda: all(r in col.finish for r in doomed), timeout=5)
        assert time.monotonic() - killed_at < 5
        assert all(col.finish[r] == FinishReason.ERROR and "engine core 1 died" in col.errors[r] for r in doomed)
        assert all("The engine actor died: " in col.errors[r] for r in doomed)
        survivors = [r for r, e in owners.items() if e == 0]
        client.add_request(request("after", max_tokens=5))
        col.until_finished(*survivors, "after")
        assert all(col.tokens[r] == expected_tokens(4, 60) for r in survivors)
        assert col.finish["after"] == FinishReason.LENGTH
        os.kill(pids[0], signal.SIGKILL)  # a crash of the last actor's process: everything fails fast
        with pytest.raises(EngineDeadError, match="Every data-parallel engine core is dead"):
            col.until(lambda: False, timeout=5)
    finally:
        client.shutdown()
    _assert_nothing_left(client, pids)


def test_dp_retry_continues_a_killed_actors_requests_on_the_other(cluster):
    from vllite.plugins.ray_dp.client import SyncRayDPClient

    config = make_config(data_parallel_size=2, data_parallel_backend="ray", step_delay_s=0.01, dp_retry=True)
    client = SyncRayDPClient(config)
    pids = [engine.resources.proc.pid for engine in client.engines]
    try:
        col = Collector(client)
        for i in range(20):
            client.add_request(request(f"r{i}", max_tokens=60))
        owners = {f"r{i}": client.router.owner(f"r{i}") for i in range(20)}
        moved = [r for r, e in owners.items() if e == 1]
        col.until(lambda: all(len(col.tokens.get(r, [])) >= 3 for r in moved))
        ray.kill(client.engines[1].resources.proc.actor, no_restart=True)
        col.until_finished(*owners)
        assert all(col.finish[r] == FinishReason.LENGTH and col.tokens[r] == expected_tokens(4, 60) for r in owners)
        assert client.dead_engines == {1}
    finally:
        client.shutdown()
    _assert_nothing_left(client, pids)


def test_no_ray_backend_without_ray_is_a_clear_error(monkeypatch):
    import importlib.util

    from vllite.plugins.ray_dp import plugin

    registered: list[str] = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    plugin.vllite_register_engine_clients(lambda name, obj: registered.append(name))
    assert registered == []
    assert "ray" in sys.modules  # (this process has Ray: the real registry keeps the backend)
