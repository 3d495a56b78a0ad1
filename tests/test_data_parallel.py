"""Data parallel end to end (``-dp 2``) with a tiny real model: greedy outputs equal ``-dp 1`` and Hugging Face
``generate()`` through ``LLM`` and ``AsyncLLM``; both engines serve; a named rank is honoured; utility calls fan
out to every engine; ``vllite serve -dp 2`` through the openai client; nothing is left behind after shutdown."""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import pytest
import torch

from vllite import LLM, SamplingParams
from vllite.sampling_params import RequestOutputKind
from vllite.testing import make_tiny_model_dir_cached

pytestmark = pytest.mark.skipif(os.environ.get("VLLITE_SKIP_MP_TESTS") == "1", reason="multiprocess tests disabled")

MAX_TOKENS = 12
ENGINE_KWARGS = {"dtype": "float32", "block_size": 16, "max_model_len": 256}


def _prompts(vocab_size: int, n: int = 10, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0, bos_token_id=None
    )
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=config)[0, len(p) :].tolist() for p in prompts]


@pytest.fixture(autouse=True)
def multiprocess(monkeypatch):
    """Data parallel runs engine processes (the test suite defaults to in-process engines)."""
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")


@pytest.fixture(scope="module")
def case():
    model_dir = str(make_tiny_model_dir_cached("llama"))
    from transformers import AutoConfig

    prompts = _prompts(AutoConfig.from_pretrained(model_dir).vocab_size)
    return model_dir, prompts, _hf_greedy(model_dir, prompts, MAX_TOKENS)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine_pids(llm: LLM) -> list[int]:
    client: Any = llm.llm_engine.engine_core
    return [engine.resources.proc.pid for engine in client.engines]


def test_llm_dp2_greedy_equals_dp1_and_hf_and_cleans_up(case):
    model_dir, prompts, expected = case
    inputs = [{"prompt_token_ids": p} for p in prompts]
    with LLM(model_dir, **ENGINE_KWARGS) as llm:
        dp1 = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, _greedy(), use_tqdm=False)]
    llm = LLM(model_dir, data_parallel_size=2, enable_sleep_mode=True, **ENGINE_KWARGS)
    client: Any = llm.llm_engine.engine_core
    try:
        outputs = llm.generate(inputs, _greedy(), use_tqdm=False)
        dp2 = [list(o.outputs[0].token_ids) for o in outputs]
        assert dp2 == dp1 == expected
        served = [engine.call_utility("get_engine_info") for engine in client.engines]
        assert len(served) == 2
        # Both engines served (their prefix caches saw queries), and utilities fan out to both.
        assert llm.llm_engine.engine_core.call_utility("get_request_counts") == [0, 0]
        assert llm.reset_prefix_cache() is True
        llm.sleep(1)
        assert all(engine.call_utility("is_sleeping") for engine in client.engines)
        llm.llm_engine.wake_up()
        assert client.call_utility("is_sleeping") is False
        again = llm.generate(inputs[:3], _greedy(), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in again] == expected[:3]
        pids = _engine_pids(llm)
        ipc_dirs = [engine.resources.endpoints.ipc_dir for engine in client.engines]
    finally:
        llm.shutdown()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
    assert not any(os.path.exists(d) for d in ipc_dirs)


def test_requests_spread_over_both_engines(case):
    model_dir, prompts, _ = case
    with LLM(model_dir, data_parallel_size=2, **ENGINE_KWARGS) as llm:
        engine_core: Any = llm.llm_engine.engine_core
        seen: list[int] = []
        original = engine_core.router.route

        def spy(request):
            engine = original(request)
            seen.append(engine)
            return engine

        engine_core.router.route = spy
        llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
        assert sorted(set(seen)) == [0, 1]
        assert abs(seen.count(0) - seen.count(1)) <= 2


def test_async_llm_dp2_streams_equal_hf_and_honour_the_rank(case):
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    model_dir, prompts, expected = case
    llm = AsyncLLM(model_dir, data_parallel_size=2, **ENGINE_KWARGS)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    routed: list[int] = []
    original = llm.engine_core.router.route
    llm.engine_core.router.route = lambda request: routed.append(original(request)) or routed[-1]

    async def one(i: int, rank: int | None) -> list[int]:
        tokens: list[int] = []
        async for out in llm.generate({"prompt_token_ids": prompts[i]}, params, f"r{i}", data_parallel_rank=rank):
            tokens.extend(out.outputs[0].token_ids)
        return tokens

    async def main() -> list[list[int]]:
        named = await asyncio.gather(*(one(i, 1) for i in range(4)))
        assert routed == [1, 1, 1, 1]
        free = await asyncio.gather(*(one(i, None) for i in range(len(prompts))))
        assert named == free[:4]
        await llm.reset_prefix_cache()
        await llm.pause_generation()
        paused = await llm.engine_core.call_utility_async("is_scheduler_paused")
        await llm.resume_generation()
        assert paused is True
        return free

    try:
        assert asyncio.run(main()) == expected
        assert sorted(set(routed[4:])) == [0, 1]
    finally:
        llm.shutdown()


def test_serve_dp2_through_the_openai_client(case):
    openai = pytest.importorskip("openai")
    from vllite.plugins.openai_server.testing import RemoteServer

    model_dir, prompts, expected = case
    args = ["--model", model_dir, "-dp", "2", "--dtype", "float32", "--max-model-len", "256"]
    with (
        RemoteServer(args) as server,
        openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client,
    ):
        for i in range(4):
            response = client.completions.create(
                model=client.models.list().data[0].id,
                prompt=prompts[i],
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={
                    "return_token_ids": True,
                    "ignore_eos": True,
                    "vllm_xargs": {"data_parallel_rank": i % 2},
                },
            )
            assert response.choices[0].model_extra["token_ids"] == expected[i]
        # vLLM's X-data-parallel-rank header names the engine too; a bad one is a 400 naming the problem.
        model = client.models.list().data[0].id
        for i in (4, 5, 6):
            response = client.completions.create(
                model=model,
                prompt=prompts[i],
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
                extra_headers={"X-data-parallel-rank": "1"},
            )
            assert response.choices[0].model_extra["token_ids"] == expected[i]
        deadline = time.monotonic() + 10  # the frontend records a request's stats as its last output arrives
        while _finished_per_engine(server.url) != {"0": 2, "1": 5}:
            assert time.monotonic() < deadline, _finished_per_engine(server.url)
            time.sleep(0.05)
        bad_headers = (("one", "X-data-parallel-rank must be an integer"), ("2", r"must be an integer in \[0, 2\)"))
        for value, message in bad_headers:
            with pytest.raises(openai.BadRequestError, match=message):
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=2,
                    extra_headers={"X-data-parallel-rank": value},
                )


def _finished_per_engine(url: str) -> dict[str, int]:
    """``vllite:request_success_total`` per ``engine`` label, from the server's ``/metrics``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics") as response:
        text = response.read().decode()
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllite:request_success_total" and sample.value:
                engine = sample.labels["engine"]
                counts[engine] = counts.get(engine, 0) + int(sample.value)
    return counts


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


_LEFT_TO_EXIT = """
import sys
from vllite import LLM, SamplingParams
llm = LLM(sys.argv[1], data_parallel_size=2, dtype="float32", block_size=16, max_model_len=256)
llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=2), use_tqdm=False)
print(*(engine.resources.proc.pid for engine in llm.llm_engine.engine_core.engines), flush=True)
# no shutdown: the LLM is collected while the interpreter exits
"""


def test_an_llm_left_to_interpreter_exit_stops_its_engines_without_hanging(case):
    """A dp LLM that its script never shuts down is stopped by its finalizer at exit. That ran the engines'
    shutdowns on new threads, which never start once the interpreter is finalizing: the exit hung for good."""
    import subprocess
    import sys

    model_dir, _, _ = case
    done = subprocess.run(
        [sys.executable, "-c", _LEFT_TO_EXIT, model_dir], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
