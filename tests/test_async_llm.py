"""``AsyncLLM`` over the engine process: concurrent streams, DELTA/CUMULATIVE, cancellation, engine death."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time

import pytest

from tests.test_engine_proc import FAKE_EXECUTOR, ensure_engine_proc_plugin, expected_tokens
from vllite.exceptions import EngineDeadError
from vllite.sampling_params import RequestOutputKind, SamplingParams


def _params(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.DELTA) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=kind, detokenize=False)


def _make_llm(step_delay_s: float = 0.0):
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    ensure_engine_proc_plugin()
    return AsyncLLM(
        executor=FAKE_EXECUTOR,
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=64,
        plugin_config={"fake_executor": {"step_delay_s": step_delay_s}},
    )


@pytest.fixture(scope="module")
def llm():
    engine = _make_llm(step_delay_s=0.001)
    yield engine
    engine.shutdown()


def test_vllite_exposes_async_llm_lazily():
    import vllite
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    assert vllite.AsyncLLM is AsyncLLM


def test_64_concurrent_streams_lose_and_duplicate_no_tokens(llm):
    async def stream(i: int) -> tuple[list[int], int, bool]:
        prompt_len, max_tokens = 3 + i % 11, 10 + i % 17
        tokens: list[int] = []
        count, finished = 0, False
        async for out in llm.generate(
            {"prompt_token_ids": list(range(1, prompt_len + 1))}, _params(max_tokens), f"s{i}"
        ):
            assert not finished, "output after the final one"
            tokens.extend(out.outputs[0].token_ids)
            finished, count = out.finished, count + 1
        assert tokens == expected_tokens(prompt_len, max_tokens), i
        return tokens, count, finished

    async def main() -> list[tuple[list[int], int, bool]]:
        return await asyncio.gather(*(stream(i) for i in range(64)))

    results = asyncio.run(main())
    assert all(finished for _, _, finished in results)
    assert sum(count for _, count, _ in results) > 64  # really streamed, not one output per request


def test_cumulative_outputs_grow_monotonically(llm):
    async def main() -> list[list[int]]:
        seen = []
        async for out in llm.generate([1, 2, 3, 4, 5], _params(12, RequestOutputKind.CUMULATIVE), "cum"):
            seen.append(list(out.outputs[0].token_ids))
        return seen

    seen = asyncio.run(main())
    assert seen[-1] == expected_tokens(5, 12)
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(seen))


def test_cancelling_a_stream_aborts_it_in_the_engine(llm):
    async def main() -> tuple[int, int]:
        first = asyncio.Event()

        async def consume(request_id: str) -> None:
            async for _ in llm.generate([1, 2, 3], _params(200), request_id):
                first.set()

        task = asyncio.create_task(consume("cancel-me"))
        await asyncio.wait_for(first.wait(), 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # An early aclose() aborts too.
        gen = llm.generate([1, 2, 3], _params(200), "close-me")
        await gen.__anext__()
        await gen.aclose()
        unfinished = await llm.call_utility("get_num_unfinished_requests")
        return unfinished, llm.output_processor.get_num_unfinished_requests()

    assert asyncio.run(main()) == (0, 0)


def test_abort_by_request_id_finishes_the_stream(llm):
    async def main() -> list[str | None]:
        reasons = []
        gen = llm.generate([1, 2], _params(300), "abort-me")
        async for out in gen:
            reasons.append(out.outputs[0].finish_reason)
            if len(reasons) == 1:
                await llm.abort("abort-me")
        return reasons

    reasons = asyncio.run(main())
    assert reasons[-1] == "abort"


def test_sigkill_raises_engine_dead_in_every_open_stream_within_5s():
    engine = _make_llm(step_delay_s=0.005)
    try:

        async def main() -> list[BaseException | None]:
            started = asyncio.Event()

            async def consume(i: int) -> BaseException | None:
                try:
                    async for _ in engine.generate([1, 2, 3], _params(5000), f"dead-{i}"):
                        started.set()
                except EngineDeadError as exc:
                    return exc
                return None

            tasks = [asyncio.create_task(consume(i)) for i in range(8)]
            await asyncio.wait_for(started.wait(), 10)
            os.kill(engine.engine_core.resources.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
            assert time.monotonic() - killed < 5
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate([1], _params(2), "after-death"):
                    pass
            with pytest.raises(EngineDeadError):
                await engine.call_utility("is_sleeping")
            return results

        results = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results)
        assert engine.errored
    finally:
        engine.shutdown()


def test_bad_logits_processor_argument_is_rejected_at_submit(llm):
    """Every loaded processor's validate_params runs in the frontend, before the engine sees the request."""

    async def main() -> None:
        bad = SamplingParams(max_tokens=2, extra_args={"thinking_token_budget": -3})
        with pytest.raises(ValueError, match="thinking_token_budget"):
            async for _ in llm.generate([1, 2, 3], bad, "bad-arg"):
                pass
        outputs = [out async for out in llm.generate([1, 2, 3], _params(2), "after-bad")]
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == 2

    asyncio.run(main())
