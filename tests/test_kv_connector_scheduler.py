"""The scheduler side of KV connectors, with ``MockKVConnector``: external hits, asynchronous loads parked in
WAITING_FOR_REMOTE_KVS without blocking the queue, deferrals, delayed frees, aborts and preemption during
transfers, load failures under both policies, and a seeded fuzz checking the KV-cache invariants."""

from __future__ import annotations

import dataclasses
import random
import zlib
from typing import Any

import pytest

from vllite.engine_args import EngineArgs
from vllite.kv_connector.base import KVConnectorRole
from vllite.kv_connector.config import KVTransferConfig
from vllite.plugins.kv_connectors.mock import MOCK_CONNECTOR, ConnectorModelRunner, MockKVConnector
from vllite.policies.continuum import ContinuumScheduler
from vllite.policies.fcfs import FCFSScheduler
from vllite.policies.priority import PriorityScheduler
from vllite.protocol import FinishReason
from vllite.request import RequestStatus
from vllite.sched import Scheduler
from vllite.testing import make_config, make_request

BS = 4


def make(
    cls: type[Scheduler] = Scheduler,
    *,
    num_blocks: int = 64,
    policy: str = "fail",
    log_stats: bool = False,
    **extra: Any,
) -> tuple[Scheduler, MockKVConnector, ConnectorModelRunner]:
    kv_config = KVTransferConfig(
        kv_connector=MOCK_CONNECTOR, kv_connector_extra_config=extra, kv_load_failure_policy=policy
    )
    config = dataclasses.replace(make_config(block_size=BS), kv_transfer_config=kv_config)
    s = cls(config, num_blocks, step_observer=None, log_stats=log_stats)
    assert isinstance(s.connector, MockKVConnector) and s.get_kv_connector() is s.connector
    worker = MockKVConnector(config, KVConnectorRole.WORKER, kv_config)
    return s, s.connector, ConnectorModelRunner(worker)


def step(s: Scheduler, runner: ConnectorModelRunner) -> tuple[Any, dict]:
    so = s.schedule()
    outputs = s.update_from_output(so, runner.execute(so))
    return so, outputs


def outs(outputs: dict) -> dict[str, Any]:
    return {o.request_id: o for eco in outputs.values() for o in eco.outputs}


def all_free(s: Scheduler, num_blocks: int = 64) -> bool:
    return s.kv_cache_manager.num_free_blocks == num_blocks - 1


def drain(s: Scheduler, runner: ConnectorModelRunner, limit: int = 200) -> None:
    for _ in range(limit):
        if not s.has_requests():
            return
        step(s, runner)
    raise AssertionError("the scheduler did not drain")


# ---------------------------------------------------------------------------- config
def test_engine_args_kv_transfer_config_json_and_errors() -> None:
    text = f'{{"kv_connector": "{MOCK_CONNECTOR}", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}}'
    config = EngineArgs(kv_transfer_config=text).create_engine_config()
    assert config.kv_transfer_config == KVTransferConfig(
        kv_connector=MOCK_CONNECTOR, kv_role="kv_consumer", kv_load_failure_policy="recompute"
    )
    assert EngineArgs().create_engine_config().kv_transfer_config is None
    for bad, field in [
        ('{"kv_connector": "x", "kv_role": "sideways"}', "kv_role"),
        ('{"kv_connector": "x", "kv_load_failure_policy": "retry"}', "kv_load_failure_policy"),
        ('{"kv_role": "kv_both"}', "kv_connector"),
        ('{"kv_connector": "x", "bogus": 1}', "bogus"),
        ("{not json", "JSON"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineArgs(kv_transfer_config=bad).create_engine_config()


def test_cli_flag_parses_json() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-transfer-config", f'{{"kv_connector": "{MOCK_CONNECTOR}"}}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.kv_transfer_config is not None and config.kv_transfer_config.kv_connector == MOCK_CONNECTOR
    assert EngineArgs.from_cli_args(parser.parse_args([])).kv_transfer_config is None


def test_no_connector_means_none() -> None:
    s = Scheduler(make_config(block_size=BS), 16, step_observer=None)
    assert s.kv_transfer is None and s.connector is None and s.get_kv_connector() is None


# ---------------------------------------------------------------------------- external hits
@pytest.mark.parametrize("matched, expect_external", [(0, 0), (6, 6), (-1, 11)])
def test_external_hits_sync(matched: int, expect_external: int) -> None:
    s, conn, runner = make(matched_tokens=matched)
    s.add_request(make_request(s, "r", list(range(12)), max_tokens=2))
    so, outputs = step(s, runner)
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == expect_external
    # The last prompt token is always computed (never loaded): it yields the first sampled token.
    assert so.num_scheduled_tokens["r"] == 12 - expect_external
    assert outs(outputs)["r"].new_token_ids
    meta = so.kv_connector_metadata
    assert ("r" in meta.loads) == (expect_external > 0)
    if expect_external:
        assert meta.loads["r"].num_tokens == expect_external and not meta.loads["r"].is_async
    drain(s, runner)
    assert conn.finished == ["r"] and all_free(s)


def test_external_after_local_prefix_hit() -> None:
    s, _conn, runner = make(matched_tokens=4)
    prompt = list(range(16))
    s.add_request(make_request(s, "a", prompt[:9], max_tokens=1))
    drain(s, runner)
    s.add_request(make_request(s, "b", prompt, max_tokens=1))
    so, _ = step(s, runner)
    # Local hit: 8 tokens (two blocks of "a"), then 4 external ones, then 4 computed.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12 and so.num_scheduled_tokens["b"] == 4
    load = so.kv_connector_metadata.loads["b"]
    assert load.block_ids == [so.scheduled_new_reqs[0].block_ids[2]] and load.num_tokens == 4
    drain(s, runner)
    assert all_free(s)


@pytest.mark.parametrize("is_async", [False, True])
def test_stats_count_each_admitted_lookup_once(is_async: bool) -> None:
    """vLLM's external prefix cache queries / hits: per admitted request, its tokens and what the connector had;
    a lookup deferred by the connector, or a load parked until it lands, is not counted twice."""
    s, conn, runner = make(log_stats=True, matched_tokens=6, is_async=is_async, load_steps=2)
    conn.overrides["miss"] = {"matched_tokens": 0}
    conn.overrides["later"] = {"matched_tokens": 6, "num_defers": 2}
    s.add_request(make_request(s, "hit", list(range(12)), max_tokens=2))
    s.add_request(make_request(s, "miss", list(range(20, 30)), max_tokens=2))
    s.add_request(make_request(s, "later", list(range(40, 49)), max_tokens=2))
    queries = hits = 0
    for _ in range(12):
        _, outputs = step(s, runner)
        for eco in outputs.values():
            if eco.scheduler_stats is not None:
                queries += eco.scheduler_stats.external_prefix_cache_queries
                hits += eco.scheduler_stats.external_prefix_cache_hits
    assert (queries, hits) == (12 + 10 + 9, 6 + 0 + 6)
    drain(s, runner)
    assert all_free(s)


def test_no_connector_no_external_stats() -> None:
    s = Scheduler(make_config(block_size=BS), 16, step_observer=None, log_stats=True)
    s.add_request(make_request(s, "r", list(range(12)), max_tokens=1))
    s.schedule()
    stats = s.make_stats()
    assert stats is not None and stats.external_prefix_cache_queries == stats.external_prefix_cache_hits == 0


# ---------------------------------------------------------------------------- async loads
def test_async_load_parks_then_resumes_without_blocking_others() -> None:
    s, conn, runner = make(matched_tokens=-1, is_async=True, load_steps=3)
    conn.overrides["plain"] = {"matched_tokens": 0}
    s.add_request(make_request(s, "remote", list(range(12)), max_tokens=2))
    s.add_request(make_request(s, "plain", list(range(100, 105)), max_tokens=2))
    so, outputs = step(s, runner)
    remote = s.requests["remote"]
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "remote" not in so.num_scheduled_tokens and "plain" in so.num_scheduled_tokens  # not held up
    assert so.kv_connector_metadata.loads["remote"].is_async
    assert len(s.kv_cache_manager.get_block_ids("remote")) == 3  # blocks allocated for the load
    assert s.kv_cache_manager.num_cached_blocks == 0 or all(
        s.kv_cache_manager.block_pool.blocks[b].block_hash is None for b in s.kv_cache_manager.get_block_ids("remote")
    )  # no prefix caching of blocks not loaded yet
    assert "remote" not in outs(outputs)
    so, _ = step(s, runner)
    assert "remote" not in so.num_scheduled_tokens and remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    so, _ = step(s, runner)  # the load lands at the end of this step
    so, outputs = step(s, runner)
    assert so.num_scheduled_tokens["remote"] == 1
    assert [n.num_computed_tokens for n in so.scheduled_new_reqs if n.req_id == "remote"] == [11]
    assert outs(outputs)["remote"].new_token_ids
    drain(s, runner)
    assert sorted(conn.finished) == ["plain", "remote"] and all_free(s)


def test_parked_requests_keep_queue_order() -> None:
    s, conn, runner = make(matched_tokens=-1, is_async=True, load_steps=50)
    for i in range(4):
        s.add_request(make_request(s, f"r{i}", list(range(i * 100, i * 100 + 9)), max_tokens=1))
    conn.overrides["r1"] = conn.overrides["r3"] = {"matched_tokens": 0}
    so, _ = step(s, runner)
    assert set(so.num_scheduled_tokens) == {"r1", "r3"}
    assert [r.request_id for r in s.waiting] == ["r0", "r2"]
    for _ in range(3):
        step(s, runner)
        assert [r.request_id for r in s.waiting] == ["r0", "r2"]


# ---------------------------------------------------------------------------- deferral
def test_deferral_then_match() -> None:
    s, conn, runner = make(matched_tokens=8, num_defers=3)
    conn.overrides["other"] = {"num_defers": 0, "matched_tokens": 0}
    s.add_request(make_request(s, "r", list(range(12)), max_tokens=1))
    s.add_request(make_request(s, "other", list(range(50, 54)), max_tokens=1))
    so, _ = step(s, runner)
    assert list(so.num_scheduled_tokens) == ["other"]  # the deferred head does not block
    for _ in range(2):
        so, _ = step(s, runner)
        assert "r" not in so.num_scheduled_tokens and s.requests["r"].status == RequestStatus.WAITING
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"r": 4} and so.scheduled_new_reqs[0].num_computed_tokens == 8
    drain(s, runner)
    assert all_free(s)


# ---------------------------------------------------------------------------- delayed free
def test_delayed_free_until_finished_sending() -> None:
    params = {"remote_engine_id": "p0", "remote_block_ids": [1, 2]}
    s, conn, runner = make(delay_free_steps=2, kv_transfer_params=params)
    s.add_request(make_request(s, "r", list(range(10)), max_tokens=1))
    so, outputs = step(s, runner)
    out = outs(outputs)["r"]
    assert out.finish_reason == FinishReason.LENGTH and out.kv_transfer_params == params
    assert "r" not in s.requests and "r" in s.kv_transfer.held
    held_blocks = s.kv_cache_manager.get_block_ids("r")
    assert held_blocks and not all_free(s)
    assert s.has_requests()  # the engine keeps stepping until the send is reported
    with pytest.raises(ValueError, match="still in use"):
        s.add_request(make_request(s, "r", [1, 2, 3]))
    so, _ = step(s, runner)
    assert so.kv_connector_metadata.sends == {"r": 2}
    assert not all_free(s)
    step(s, runner)
    assert all_free(s) and not s.kv_transfer.held and not s.has_requests()
    assert conn.finished == ["r"]


def test_kv_transfer_params_on_the_finish_output() -> None:
    s, _, runner = make(kv_transfer_params={"k": 1})
    s.add_request(make_request(s, "r", [1, 2, 3], max_tokens=1))
    _, outputs = step(s, runner)
    assert outs(outputs)["r"].kv_transfer_params == {"k": 1}


# ---------------------------------------------------------------------------- aborts and preemption
def test_abort_while_loading_frees_once_the_load_lands() -> None:
    s, conn, runner = make(matched_tokens=-1, is_async=True, load_steps=3)
    s.add_request(make_request(s, "r", list(range(12)), max_tokens=2))
    step(s, runner)
    assert s.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert conn.finished == ["r"] and "r" not in s.requests and not s.waiting
    assert not all_free(s), "the worker may still write into the blocks"
    for _ in range(3):
        step(s, runner)
    assert all_free(s) and not s.kv_transfer.held and not s.kv_transfer.remote_loads
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)  # twice: harmless
    assert conn.finished == ["r"] and all_free(s)


def test_abort_while_sending() -> None:
    s, conn, runner = make(delay_free_steps=3)
    s.add_request(make_request(s, "r", list(range(10)), max_tokens=50))
    step(s, runner)
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert conn.finished == ["r"] and not all_free(s)
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert conn.finished == ["r"]
    drain(s, runner)
    assert all_free(s) and conn.finished == ["r"]


def test_preemption_during_a_load() -> None:
    # 8 usable blocks: a parked load holds 3, two running requests fight over the rest.
    s, conn, runner = make(num_blocks=9, matched_tokens=-1, is_async=True, load_steps=6)
    conn.overrides["a"] = conn.overrides["b"] = {"matched_tokens": 0}
    s.add_request(make_request(s, "remote", list(range(12)), max_tokens=3))
    step(s, runner)
    s.add_request(make_request(s, "a", list(range(100, 107)), max_tokens=12, ignore_eos=True))
    s.add_request(make_request(s, "b", list(range(200, 207)), max_tokens=12, ignore_eos=True))
    preempted = 0
    for _ in range(60):
        if not s.has_requests():
            break
        so, _ = step(s, runner)
        preempted += len(so.preempted_req_ids)
        assert "remote" not in so.preempted_req_ids
    assert preempted > 0, "the scenario should preempt"
    assert not s.has_requests() and all_free(s, 9)
    assert sorted(conn.finished) == ["a", "b", "remote"]


def test_preempted_request_asks_the_connector_again() -> None:
    s, conn, runner = make(num_blocks=7, matched_tokens=4)
    conn.overrides["hog"] = {"matched_tokens": 0}
    s.add_request(make_request(s, "r", list(range(9)), max_tokens=12, ignore_eos=True))
    s.add_request(make_request(s, "hog", list(range(100, 109)), max_tokens=12, ignore_eos=True))
    preempted = set()
    for _ in range(80):
        if not s.has_requests():
            break
        so, _ = step(s, runner)
        preempted |= so.preempted_req_ids
    assert preempted and not s.has_requests() and all_free(s, 7)
    assert conn.calls["get_num_new_matched_tokens"] > 2


# ---------------------------------------------------------------------------- load failures
@pytest.mark.parametrize("is_async", [False, True])
def test_load_failure_fail_policy(is_async: bool) -> None:
    s, conn, runner = make(policy="fail", matched_tokens=8, is_async=is_async, fail_loads=1)
    conn.overrides["ok"] = {"matched_tokens": 0}
    s.add_request(make_request(s, "r", list(range(12)), max_tokens=3))
    s.add_request(make_request(s, "ok", list(range(50, 55)), max_tokens=3))
    seen: dict[str, Any] = {}
    for _ in range(20):
        if not s.has_requests():
            break
        _, outputs = step(s, runner)
        seen.update({k: v for k, v in outs(outputs).items() if v.finish_reason is not None})
    assert seen["r"].finish_reason == FinishReason.ERROR and "failed to load KV blocks" in seen["r"].error
    assert "kv_load_failure_policy='fail'" in seen["r"].error
    assert seen["ok"].finish_reason == FinishReason.LENGTH
    assert sorted(conn.finished) == ["ok", "r"] and all_free(s)
    # The failed block never serves a prefix-cache hit.
    invalid = set().union(*(o.invalid_block_ids for o in conn.outputs))
    assert invalid and all(s.kv_cache_manager.block_pool.blocks[b].block_hash is None for b in invalid)


@pytest.mark.parametrize("is_async", [False, True])
def test_load_failure_recompute_policy(is_async: bool) -> None:
    s, conn, runner = make(policy="recompute", matched_tokens=8, is_async=is_async, fail_loads=1)
    s.add_request(make_request(s, "r", list(range(12)), max_tokens=3, ignore_eos=True))
    scheduled: list[int] = []
    finished = None
    for _ in range(20):
        if not s.has_requests():
            break
        so, outputs = step(s, runner)
        scheduled.append(so.num_scheduled_tokens.get("r", 0))
        out = outs(outputs).get("r")
        if out is not None and out.finish_reason is not None:
            finished = out
    assert finished is not None and finished.finish_reason == FinishReason.LENGTH
    assert len(finished.new_token_ids) >= 1
    if is_async:
        # Nothing usable landed (the first block failed): the request starts over and the connector, asked
        # again, loads it a second time (successfully); 4 prompt tokens and 2 decodes are computed.
        assert sum(scheduled) == 4 + 2 and conn.calls["get_num_new_matched_tokens"] == 2
    else:
        # The failed block is the first loaded one: everything from it is computed again (all 12 prompt tokens).
        assert sum(scheduled) == 4 + 12 + 2
    invalid = set().union(*(o.invalid_block_ids for o in conn.outputs))
    assert invalid, "a load should have failed"
    assert conn.finished == ["r"] and all_free(s)


def test_recompute_drops_tokens_sampled_on_a_failed_load_and_evicts_the_blocks() -> None:
    s, conn, runner = make(policy="recompute", matched_tokens=-1, fail_loads=1)
    s.add_request(make_request(s, "r", list(range(12)), max_tokens=2, ignore_eos=True))
    so, outputs = step(s, runner)
    assert so.num_scheduled_tokens == {"r": 1}
    assert "r" not in outs(outputs), "tokens sampled on top of a failed load are dropped"
    request = s.requests["r"]
    assert request.num_computed_tokens == 0 and request.num_output_tokens == 0
    invalid = conn.outputs[-1].invalid_block_ids
    assert all(s.kv_cache_manager.block_pool.blocks[b].block_hash is None for b in invalid)
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"r": 12}
    drain(s, runner)
    assert all_free(s)


# ---------------------------------------------------------------------------- policies and fuzz
def check_kv_invariants(s: Scheduler) -> None:
    """Block ref counts equal the requests holding them; every holder is live or held for the connector."""
    kv = s.kv_cache_manager
    pool = kv.block_pool
    holders = {rid: blocks for rid, blocks in kv.manager.req_to_blocks.items() if blocks}
    live = set(s.requests) | set(s.kv_transfer.held if s.kv_transfer else ())
    pinned = {p.request.request_id for p in getattr(s, "_pins", {}).values()}
    assert set(holders) <= live | pinned, f"blocks of gone requests: {set(holders) - live - pinned}"
    users: dict[int, int] = {}
    for blocks in holders.values():
        for block in blocks:
            if not block.is_null:
                users[block.block_id] = users.get(block.block_id, 0) + 1
    for block in pool.blocks[1:]:
        assert block.ref_cnt == users.get(block.block_id, 0), block
    queued = list(pool.free_block_queue)
    assert len(queued) == pool.get_num_free_blocks() == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0)
    for r in s.running:
        assert len(kv.get_block_ids(r.request_id)) * BS >= r.num_computed_tokens
    for r in s.waiting:
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert r.request_id in s.kv_transfer.remote_loads
    assert {r.request_id for r in s.running} | {r.request_id for r in s.waiting} == set(s.requests)


@pytest.mark.parametrize("cls", [FCFSScheduler, PriorityScheduler, ContinuumScheduler])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_fuzz_connector_answers_at_random(cls: type[Scheduler], policy: str, seed: int = 0) -> None:
    rng = random.Random(zlib.crc32(f"{cls.__name__}-{policy}-{seed}".encode()))
    num_blocks = 1 + 14
    kv_config = KVTransferConfig(
        kv_connector=MOCK_CONNECTOR, kv_connector_extra_config={"seed": seed}, kv_load_failure_policy=policy
    )
    config = dataclasses.replace(
        make_config(block_size=BS, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=48),
        kv_transfer_config=kv_config,
    )
    kwargs: dict[str, Any] = {"estimator": _NoPins()} if cls is ContinuumScheduler else {}
    s = cls(config, num_blocks, step_observer=None, **kwargs)
    worker = MockKVConnector(config, KVConnectorRole.WORKER, kv_config)
    runner = ConnectorModelRunner(worker, choose=lambda rid, pos: 3 if rng.random() < 0.05 else rng.randrange(10, 500))
    prefixes = [[rng.randrange(10, 500) for _ in range(12)] for _ in range(3)]
    conn = s.connector
    assert isinstance(conn, MockKVConnector)
    next_id = 0
    added: list[str] = []
    seen = {"parked": 0, "held": 0, "invalid": 0, "preempted": 0}
    for _ in range(5000):
        if rng.random() < 0.3:
            n = rng.randrange(2, 30)
            tokens = (rng.choice(prefixes) + [rng.randrange(10, 500) for _ in range(n)])[:n]
            rid = f"r{next_id}"
            next_id += 1
            s.add_request(make_request(s, rid, tokens, eos_token_id=3, max_tokens=rng.randrange(1, 20)))
            added.append(rid)
        if s.requests and rng.random() < 0.05:
            s.finish_requests(rng.choice(list(s.requests)), RequestStatus.FINISHED_ABORTED)
        so = s.schedule()
        seen["preempted"] += len(so.preempted_req_ids)
        s.update_from_output(so, runner.execute(so))
        seen["parked"] += bool(s.kv_transfer.remote_loads)
        seen["held"] += bool(s.kv_transfer.held)
        seen["invalid"] += bool(conn.outputs and conn.outputs[-1].invalid_block_ids)
        check_kv_invariants(s)
    for _ in range(3000):
        if not s.has_requests():
            break
        so = s.schedule()
        s.update_from_output(so, runner.execute(so))
        check_kv_invariants(s)
    assert not s.has_requests(), "a hang: requests or transfers never finished"
    if hasattr(s, "release_all_pins"):
        s.release_all_pins()
    assert s.kv_cache_manager.num_free_blocks == num_blocks - 1, "a leaked block"
    assert worker.num_transfers_in_flight == 0
    # request_finished exactly once per request that was admitted to the scheduler.
    assert sorted(conn.finished) == sorted(added) and len(set(conn.finished)) == len(conn.finished)
    assert all(v > 20 for v in seen.values()), seen


class _NoPins:
    """A Continuum estimator that never pins (the fuzz checks the connector paths, not pins)."""

    def request_arrives(self, request: Any, now: float) -> None: ...

    def request_finished(self, request: Any, now: float) -> None: ...

    def set_up_pin(self, request: Any, now: float) -> float:
        return 0.0
