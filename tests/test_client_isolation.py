"""Client-side fault isolation and shutdown (issue 13): one request whose output cannot be processed fails alone,
and ``shutdown()`` wakes every blocked caller and stream.

A model-free executor (``PositionTokenExecutor``: token ``1000 + position``) makes each request's tokens known from
its prompt length, so a tokenizer whose ``decode`` raises on one token id fails exactly the requests that reach
that position: here only the one with a 25-token prompt (token 1030 is its sixth output token).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from tests.test_engine_proc import FAKE_EXECUTOR, ensure_engine_proc_plugin, expected_tokens
from vllite.exceptions import EngineClientClosedError, RequestProcessingError
from vllite.sampling_params import RequestOutputKind, SamplingParams

BAD_TOKEN = 1030
BAD_PROMPT_LEN = 25  # positions 25.. → tokens 1025..; decoding 1030 raises


class FaultyTokenizer:
    """Decodes ids as ``<id>``; ``decode`` raises for any window holding ``bad_token``."""

    def __init__(self, bad_token: int) -> None:
        self.bad_token = bad_token

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        if self.bad_token in ids:
            raise RuntimeError(f"cannot decode token {self.bad_token}")
        return "".join(f"<{i}>" for i in ids)


def _prompt(length: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": list(range(1, length + 1))}


def _engine_kwargs(step_delay_s: float) -> dict[str, Any]:
    return {
        "executor": FAKE_EXECUTOR,
        "skip_tokenizer_init": True,
        "max_model_len": 512,
        "plugin_config": {"fake_executor": {"step_delay_s": step_delay_s}},
    }


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ---------------------------------------------------------------------------- one request's output fails
@pytest.mark.parametrize("multiprocess", ["1", "0"])
def test_llm_generate_keeps_the_batch_when_one_request_fails_to_decode(monkeypatch, multiprocess):
    from vllite import LLM

    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", multiprocess)
    ensure_engine_proc_plugin()
    llm = LLM(**_engine_kwargs(step_delay_s=0.005))
    try:
        llm.llm_engine.output_processor.tokenizer = FaultyTokenizer(BAD_TOKEN)
        params = [
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True),  # would run long after the failure
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        ]
        outputs = llm.generate([_prompt(4), _prompt(BAD_PROMPT_LEN), _prompt(40)], params, use_tqdm=False)

        assert [out.request_id for out in outputs] == ["0", "1", "2"]
        for out, prompt_len in ((outputs[0], 4), (outputs[2], 40)):
            assert out.outputs[0].finish_reason == "length"
            assert out.outputs[0].token_ids == expected_tokens(prompt_len, 8)
            assert out.outputs[0].text == "".join(f"<{t}>" for t in expected_tokens(prompt_len, 8))
        failed = outputs[1].outputs[0]
        assert outputs[1].finished and failed.finish_reason == "error"
        assert failed.error is not None and "'1'" in failed.error and f"cannot decode token {BAD_TOKEN}" in failed.error
        assert failed.text == "".join(f"<{t}>" for t in range(1025, BAD_TOKEN))  # the text decoded before
        # The failed request is gone from the frontend and the engine; the engine serves the next call.
        assert llm.llm_engine.get_num_unfinished_requests() == 0
        engine = llm.llm_engine.engine_core
        _wait_for(lambda: engine.call_utility("get_num_unfinished_requests") == 0, timeout=5)
        again = llm.generate(_prompt(6), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert again[0].outputs[0].token_ids == expected_tokens(6, 4)
    finally:
        llm.shutdown()


def test_n_greater_than_one_fails_as_one_request_with_every_sample_marked():
    from vllite.engine.output_processor import OutputProcessor
    from vllite.engine.parallel_sampling import ParentRequest
    from vllite.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason

    params = SamplingParams(n=3, max_tokens=50, output_kind=RequestOutputKind.FINAL_ONLY)
    request = EngineCoreRequest("p", [1, 2, 3], params, None, time.time())
    proc = OutputProcessor(FaultyTokenizer(BAD_TOKEN))
    parent = ParentRequest(request, "ext")
    for index in range(3):
        child_id, child_params = parent.get_child_info(index)
        child = EngineCoreRequest(child_id, [1, 2, 3], child_params, None, time.time())
        proc.add_request(child, None, parent, index)
    # FINAL_ONLY text is decoded when a sample finishes: p-1 fails as it ends, and its unfinished siblings with it.
    result = proc.process_outputs(
        [EngineCoreOutput("p-0", [7]), EngineCoreOutput("p-1", [BAD_TOKEN], finish_reason=FinishReason.LENGTH)]
    )

    assert sorted(result.reqs_to_abort) == ["p-0", "p-1", "p-2"]
    assert proc.get_num_unfinished_requests() == 0 and not proc.parent_requests
    [out] = result.request_outputs
    assert out.request_id == "ext" and out.finished
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert {c.finish_reason for c in out.outputs} == {"error"}
    assert out.outputs[0].text == "<7>"


def _async_llm(step_delay_s: float):
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    ensure_engine_proc_plugin()
    return AsyncLLM(**_engine_kwargs(step_delay_s))


def _delta(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


async def _collect(llm: Any, prompt_len: int, max_tokens: int, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for out in llm.generate(_prompt(prompt_len), _delta(max_tokens), request_id):
        tokens.extend(out.outputs[0].token_ids)
    return tokens


def test_async_llm_decode_failure_fails_only_its_stream():
    llm = _async_llm(step_delay_s=0.005)
    try:
        llm.output_processor.tokenizer = FaultyTokenizer(BAD_TOKEN)

        async def main() -> tuple[list[Any], list[int], int, int]:
            good = [(f"g{i}", 3 + i, 20) for i in range(6)]  # tokens up to 1027
            jobs = [_collect(llm, plen, n, rid) for rid, plen, n in good]
            jobs.insert(3, _collect(llm, BAD_PROMPT_LEN, 400, "bad"))
            results = await asyncio.gather(*jobs, return_exceptions=True)
            after = await _collect(llm, 5, 10, "after")  # a later request works
            frontend_open = llm.output_processor.get_num_unfinished_requests()
            engine_open = await llm.call_utility("get_num_unfinished_requests")
            return results, after, frontend_open, engine_open

        results, after, frontend_open, engine_open = asyncio.run(main())
        failure = results.pop(3)
        assert isinstance(failure, RequestProcessingError), failure
        assert failure.request_id == "bad" and f"cannot decode token {BAD_TOKEN}" in str(failure)
        assert results == [expected_tokens(3 + i, 20) for i in range(6)]
        assert after == expected_tokens(5, 10)
        assert frontend_open == 0
        assert engine_open == 0  # the failed request (400 tokens) was aborted, not left running
        assert not llm.errored
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------- shutdown wakes everyone
@pytest.mark.parametrize("caller", ["event_loop", "other_thread"])
def test_async_llm_shutdown_ends_every_open_stream(caller):
    llm = _async_llm(step_delay_s=0.01)
    try:

        async def main() -> tuple[list[Any], float]:
            started = [asyncio.Event() for _ in range(4)]

            async def stream(i: int) -> None:
                async for _ in llm.generate(_prompt(3 + i), _delta(400), f"s{i}"):
                    started[i].set()

            tasks = [asyncio.create_task(stream(i)) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=20)
            start = time.monotonic()
            if caller == "event_loop":
                llm.shutdown()
            else:
                await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
            done, pending = await asyncio.wait(tasks, timeout=5)
            elapsed = time.monotonic() - start
            assert not pending, "a stream stayed blocked after shutdown()"
            return [task.exception() for task in done], elapsed

        errors, elapsed = asyncio.run(main())
        assert len(errors) == 4
        assert all(isinstance(exc, EngineClientClosedError) for exc in errors), errors
        assert "shut down" in str(errors[0])
        assert elapsed < 5
        with pytest.raises(EngineClientClosedError):
            asyncio.run(_collect(llm, 3, 3, "late"))
    finally:
        llm.shutdown()


def _llm_engine(step_delay_s: float):
    from vllite.engine.llm_engine import LLMEngine
    from vllite.engine_args import EngineArgs

    ensure_engine_proc_plugin()
    return LLMEngine(EngineArgs(**_engine_kwargs(step_delay_s)).create_engine_config(), multiprocess=True)


def _run_in_thread(fn: Any, errors: dict[str, BaseException], name: str) -> threading.Thread:
    def target() -> None:
        try:
            while True:
                fn()
        except BaseException as exc:
            errors[name] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("engine_state", ["idle", "hung"])
def test_shutdown_wakes_sync_callers_blocked_on_another_thread(engine_state):
    engine = _llm_engine(step_delay_s=0.01)
    pid = engine.engine_core.resources.proc.pid
    stopped = False
    try:
        errors: dict[str, BaseException] = {}
        if engine_state == "hung":
            engine.add_request("r", _prompt(4), SamplingParams(max_tokens=400, ignore_eos=True, detokenize=False))
            _wait_for(lambda: engine.step() is not None and engine.engine_core.call_utility("get_request_counts")[0])
            os.kill(pid, signal.SIGSTOP)  # a hung engine: nothing more arrives
            stopped = True
        threads = [
            _run_in_thread(engine.step, errors, "step"),
            _run_in_thread(lambda: engine.engine_core.call_utility("get_num_unfinished_requests"), errors, "utility"),
        ]
        time.sleep(0.5)
        assert all(thread.is_alive() for thread in threads) and not errors  # really blocked
        start = time.monotonic()
        shutdown = threading.Thread(target=engine.shutdown, daemon=True)
        shutdown.start()
        for thread in threads:
            thread.join(timeout=3)
        woke_after = time.monotonic() - start
        assert not any(thread.is_alive() for thread in threads), "a caller stayed blocked after shutdown()"
        assert woke_after < 2.5  # before the 5 s kill fallback a hung engine's exit takes
        assert set(errors) == {"step", "utility"}
        assert all(isinstance(exc, EngineClientClosedError) for exc in errors.values()), errors
        shutdown.join(timeout=15)
        assert not shutdown.is_alive()
        with pytest.raises(EngineClientClosedError):
            engine.step()  # sticky
    finally:
        if stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.shutdown()
