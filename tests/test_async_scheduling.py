"""Async scheduling (``--async-scheduling``): step N+1 planned on output placeholders while step N runs.

The oracle is the synchronous path (itself equal to Hugging Face ``generate()``): greedy outputs, stop conditions,
aborts and preemptions give exactly the same tokens, in-process and in the engine process; a seeded fuzz of the
scheduler driven as the engine drives it (two steps in flight, executed in order) keeps the KV-cache invariants
and leaves every block free.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zlib
from pathlib import Path

import pytest

from tests.test_generation_equivalence import _assert_equal, _hf_greedy, _prompts
from tests.test_kv_connector_scheduler import check_kv_invariants
from vllite import LLM, SamplingParams
from vllite.engine.core import EngineCore
from vllite.engine_args import EngineArgs
from vllite.policies.fcfs import FCFSScheduler
from vllite.policies.priority import PriorityScheduler
from vllite.request import RequestStatus
from vllite.sched import Scheduler
from vllite.sched.async_scheduler import AsyncSchedulingMixin, async_scheduler_cls, create_async_scheduler
from vllite.testing import (
    PositionTokenExecutor,
    ScriptedModelRunner,
    make_config,
    make_request,
    make_tiny_model_dir_cached,
)

EOS = 3
BLOCK_SIZE = 4


# ---------------------------------------------------------------------------- scheduler, no model
def _token(request_id: str, position: int) -> int:
    """A token fixed by (request, position): sync and async runs sample the same tokens, preempted or not."""
    h = zlib.crc32(f"{request_id}:{position}".encode())
    return EOS if h % 23 == 0 else 10 + h % 490


def _run(cls: type[Scheduler], requests: list[dict], *, num_blocks: int, depth: int, seed: int, aborts: bool):
    """Drives ``cls`` as the engine does: ``depth`` steps in flight, executed in order as they are scheduled, outputs
    applied oldest first. Returns ``{request_id: (tokens, finish_reason)}`` and the scheduler."""
    rng = random.Random(seed)
    config = make_config(max_num_batched_tokens=24, max_num_seqs=6, max_model_len=48, block_size=BLOCK_SIZE)
    s = cls(config, num_blocks, step_observer=None)
    runner = ScriptedModelRunner(choose=_token)
    pending = list(requests)
    results: dict[str, tuple[list[int], str | None]] = {}
    in_flight: list = []
    steps = 0
    while pending or s.has_requests() or in_flight:
        steps += 1
        assert steps < 5000, "requests did not finish: a deadlock"
        for _ in range(rng.randrange(3)):
            if pending:
                spec = pending.pop(0)
                s.add_request(make_request(s, spec["id"], spec["prompt"], eos_token_id=EOS, **spec["params"]))
                results[spec["id"]] = ([], None)
        if aborts and s.requests and rng.random() < 0.04:
            victim = rng.choice(list(s.requests))
            s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            results[victim] = (results[victim][0], "abort")
        scheduled = s.has_requests()
        if scheduled:
            so = s.schedule()
            check_kv_invariants(s)
            in_flight.append((so, runner.execute(so)))  # the executor runs steps in the order they are scheduled
        if in_flight and (len(in_flight) == depth or not scheduled):
            so, out = in_flight.pop(0)
            for outputs in s.update_from_output(so, out).values():
                for o in outputs.outputs:
                    tokens, reason = results[o.request_id]
                    assert reason is None, f"{o.request_id}: output after it finished"
                    tokens.extend(o.new_token_ids)
                    results[o.request_id] = (tokens, str(o.finish_reason) if o.finish_reason is not None else None)
            check_kv_invariants(s)
    return results, s


def _workload(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        params = {"max_tokens": rng.choice([1, 2, 3, 8, 20]), "ignore_eos": rng.random() < 0.2}
        if rng.random() < 0.3:
            params["min_tokens"] = rng.randrange(0, params["max_tokens"] + 1)
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.randrange(10, 500) for _ in range(20)]
        out.append(
            {"id": f"r{i}", "prompt": [rng.randrange(10, 500) for _ in range(rng.randrange(1, 30))], "params": params}
        )
    return out


@pytest.mark.parametrize("cls", [FCFSScheduler, PriorityScheduler])
def test_scheduler_equals_sync_with_preemption(cls: type[Scheduler]) -> None:
    """Same tokens and finish reasons as the synchronous scheduler, EOS, stop ids, max_tokens 1/2 and min_tokens
    included, with a KV cache small enough to preempt; every block free at the end."""
    workload = _workload(300, seed=7)
    expected, _ = _run(cls, workload, num_blocks=1 + 20, depth=1, seed=1, aborts=False)
    got, s = _run(async_scheduler_cls(cls), workload, num_blocks=1 + 20, depth=2, seed=1, aborts=False)
    assert got == expected
    assert s.num_preemptions_total > 10, "the small KV cache was meant to force preemptions"
    assert any(len(tokens) < spec["params"]["max_tokens"] for spec in workload for tokens, _ in [got[spec["id"]]])
    assert s.kv_cache_manager.num_free_blocks == 20 and not s.requests


@pytest.mark.parametrize("seed", range(3))
def test_scheduler_fuzz_with_aborts_frees_every_block(seed: int) -> None:
    """Random arrivals, aborts (also of requests in the step in flight) and preemptions: the invariants hold after
    every schedule and update, no output follows a finish, and every block is free at the end."""
    _, s = _run(
        async_scheduler_cls(FCFSScheduler), _workload(400, seed), num_blocks=1 + 16, depth=2, seed=seed, aborts=True
    )
    assert s.kv_cache_manager.num_free_blocks == 16 and not s.requests and not s.running and not s.waiting
    assert s.num_steps_in_flight == 0


def test_decode_is_scheduled_ahead_of_its_token() -> None:
    """Step 2 schedules the next decode before step 1's token is known; max_tokens=2 is never overshot."""
    s = async_scheduler_cls(FCFSScheduler)(make_config(), 64, step_observer=None)
    runner = ScriptedModelRunner()
    s.add_request(make_request(s, "r", [5, 6, 7], max_tokens=2))
    first = s.schedule()
    out1 = runner.execute(first)
    second = s.schedule()  # step 1 still "running"
    assert second.num_scheduled_tokens == {"r": 1}
    assert second.scheduled_cached_reqs.num_output_tokens == [1]  # the workers hold step 1's token
    request = s.requests["r"]
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 4
    out2 = runner.execute(second)
    third = s.schedule()  # two tokens in flight reach max_tokens: nothing more to schedule
    assert third.num_scheduled_tokens == {}
    s.update_from_output(first, out1)
    assert request.output_token_ids == [1003] and request.num_output_placeholders == 1
    outputs = s.update_from_output(second, out2)
    assert outputs[0].outputs[0].new_token_ids == [1004] and request.is_finished()
    s.update_from_output(third, runner.execute(third))
    assert s.kv_cache_manager.num_free_blocks == 63


def test_refuses_what_it_cannot_serve() -> None:
    """The async scheduler checks its own config: when the engine is created, before anything loads (``x`` is no
    model folder), and when the scheduler is made."""
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"--async-scheduling.*--speculative-config"):
        LLM(model="x", async_scheduling=True, speculative_config=spec)
    with pytest.raises(ValueError, match=r"--async-scheduling.*--kv-transfer-config"):
        LLM(model="x", async_scheduling=True, kv_offload_size=1.0)
    config = EngineArgs(model="x", async_scheduling=True, kv_offload_size=1.0).create_engine_config()
    with pytest.raises(ValueError, match=r"--async-scheduling.*--kv-transfer-config"):
        create_async_scheduler(config.with_limits(64, 16), 16)
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling


# ---------------------------------------------------------------------------- engine core, fake executor
def test_abort_mid_flight_in_engine_core() -> None:
    """An abort while the request's next step is in flight: no token after the abort, blocks freed once."""
    config = EngineArgs(
        model="fake", max_model_len=128, num_gpu_blocks_override=64, block_size=4, async_scheduling=True
    ).create_engine_config()
    core = EngineCore(config, executor_class=PositionTokenExecutor)
    try:
        assert isinstance(core.scheduler, AsyncSchedulingMixin) and core.batch_queue_size == 2
        from vllite.protocol import EngineCoreRequest

        for i in range(4):
            core.add_request(
                EngineCoreRequest(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=30, ignore_eos=True), None, 0.0)
            )
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
        aborted_at = None
        for _ in range(200):
            if not core.has_work():
                break
            outputs, _ = core.step_fn()
            for eco in (outputs or {}).values():
                for o in eco.outputs:
                    assert not (o.request_id == "r1" and aborted_at is not None), "a token after the abort"
                    tokens[o.request_id].extend(o.new_token_ids)
            if aborted_at is None and len(tokens["r1"]) >= 5:
                assert core.batch_queue, "the abort must land while a step is in flight"
                core.abort_requests(["r1"])
                aborted_at = len(tokens["r1"])
        assert aborted_at is not None and len(tokens["r1"]) == aborted_at
        for rid in ("r0", "r2", "r3"):
            assert len(tokens[rid]) == 30
        assert core.scheduler.kv_cache_manager.num_free_blocks == 63
    finally:
        core.shutdown()


# ---------------------------------------------------------------------------- the model, vs sync and HF
@pytest.fixture(scope="module")
def llama_case():
    model_dir = str(make_tiny_model_dir_cached("llama"))
    from transformers import AutoConfig

    prompts = _prompts(AutoConfig.from_pretrained(model_dir).vocab_size)
    return model_dir, prompts, _hf_greedy(model_dir, prompts, 12)


def _generate(model_dir: str, prompts, params, **engine_kwargs):
    engine_kwargs = {"max_model_len": 256, **engine_kwargs}
    with LLM(model_dir, dtype="float32", block_size=16, **engine_kwargs) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _greedy(max_tokens: int = 12, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def test_equal_to_hf_in_process(llama_case, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    model_dir, prompts, expected = llama_case
    params = _greedy(ignore_eos=True, logprobs=2)
    _assert_equal(_generate(model_dir, prompts, params, max_num_batched_tokens=24, async_scheduling=True), expected)


@pytest.mark.skipif(os.environ.get("VLLITE_SKIP_MP_TESTS") == "1", reason="multiprocess tests disabled")
def test_equal_to_hf_in_engine_process(llama_case, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")
    model_dir, prompts, expected = llama_case
    params = _greedy(ignore_eos=True, logprobs=2)
    outputs = _generate(
        model_dir,
        prompts,
        params,
        max_num_batched_tokens=24,
        num_gpu_blocks_override=14,
        max_model_len=208,
        async_scheduling=True,
    )
    _assert_equal(outputs, expected)


def test_preemption_with_small_kv_cache(llama_case, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    model_dir, prompts, expected = llama_case
    with LLM(
        model_dir, dtype="float32", block_size=16, num_gpu_blocks_override=12, max_model_len=176, async_scheduling=True
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(ignore_eos=True), use_tqdm=False)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.num_preemptions_total > 0, "the small KV cache was meant to force preemptions"
        assert scheduler.kv_cache_manager.num_free_blocks == 11
    _assert_equal(outputs, expected, check_logprobs=False)


@pytest.mark.parametrize("multiprocess", ["0", "1"])
def test_stop_conditions_equal_sync(llama_case, monkeypatch, tmp_path, multiprocess: str) -> None:
    """EOS (ignore_eos False), stop_token_ids, max_tokens 1 and 2 and min_tokens: exactly the synchronous outputs."""
    if multiprocess == "1" and os.environ.get("VLLITE_SKIP_MP_TESTS") == "1":
        pytest.skip("multiprocess tests disabled")
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", multiprocess)
    base_dir, prompts, expected = llama_case
    # EOS: the same weights with, as eos, a token the greedy continuations emit early (no tokenizer: the eos comes
    # from generation_config.json).
    eos = expected[0][0][3]
    model_dir = str(tmp_path / "model")
    shutil.copytree(base_dir, model_dir)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        fields = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
        fields["eos_token_id"] = eos
        with open(path, "w") as f:
            json.dump(fields, f)
    stop_ids = [tokens[2] for tokens, _ in expected[:4]]
    cases = [
        _greedy(max_tokens=24),
        _greedy(max_tokens=24, stop_token_ids=stop_ids),
        _greedy(max_tokens=24, stop_token_ids=stop_ids, min_tokens=6),
        _greedy(max_tokens=1),
        _greedy(max_tokens=2),
    ]
    for params in cases:
        sync = _generate(model_dir, prompts, params, max_num_batched_tokens=40, skip_tokenizer_init=True)
        ahead = _generate(
            model_dir, prompts, params, max_num_batched_tokens=40, skip_tokenizer_init=True, async_scheduling=True
        )
        got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in ahead]
        assert got == [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in sync], params
        assert all(len(tokens) <= params.max_tokens for tokens, _ in got)
        if params.max_tokens == 24:
            assert any(reason == "stop" for _, reason in got), "the case was meant to stop early"


def test_structured_outputs_wait_for_their_tokens(monkeypatch) -> None:
    """Constrained requests are not scheduled ahead (their grammar must accept the in-flight token first):
    their outputs stay valid and every output, constrained or not, equals the synchronous engine's."""
    import re

    from vllite.structured_output import StructuredOutputsParams

    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    model_dir = str(make_tiny_model_dir_cached("llama"))
    regex, choices = r"[a-z]{2,6}-[0-9]{2}", ["positive", "negative", "neutral"]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [
        plain,
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)),
        plain,
        SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(choice=choices)),
    ]
    prompts = ["Once upon a time", "def main():", "The weather", "import numpy"]
    results = []
    for async_scheduling in (False, True):
        with LLM(model_dir, max_model_len=256, async_scheduling=async_scheduling) as llm:
            results.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
    sync, ahead = results
    assert [o.token_ids for o in ahead] == [o.token_ids for o in sync]
    assert re.fullmatch(regex, ahead[1].text) and ahead[3].text in choices


def test_seeded_sampling_and_penalties_equal_sync(llama_case, monkeypatch) -> None:
    """The executor's own view of each request (tokens in flight included) drives seeded sampling and penalties:
    the same outputs as the synchronous engine."""
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    model_dir, prompts, _ = llama_case
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5)
        for i in range(len(prompts))
    ]
    sync = _generate(model_dir, prompts, params, max_num_batched_tokens=40)
    ahead = _generate(model_dir, prompts, params, max_num_batched_tokens=40, async_scheduling=True)
    assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in sync]
