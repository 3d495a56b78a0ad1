"""Sessions (resumable requests with streaming input): the oracle is the same engine given the whole history as one
prompt each turn; the KV kept between turns means each turn prefills only its new tokens.

In-process (``LLMEngine``), in the engine-core process, and through ``AsyncLLM.generate`` over ``StreamingInput``
chunks; then memory pressure (200 sessions on a KV cache that holds a quarter of them), the hold policy, and bad
input (each failure ends that session alone).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from vllite.engine.llm_engine import LLMEngine
from vllite.engine.sessions import StreamingInput
from vllite.engine_args import EngineArgs
from vllite.exceptions import SessionClosedError
from vllite.outputs import RequestOutput
from vllite.sampling_params import RequestOutputKind, SamplingParams
from vllite.testing import make_tiny_model_dir_cached

CHUNKS = ["Hello there, my friend", " and then", " what about the", " end of it", " really now"]


def turn_params(turn: int, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> SamplingParams:
    return SamplingParams(max_tokens=4 + turn, temperature=0.0, ignore_eos=True, output_kind=kind)


def make_engine(multiprocess: bool = False, **kwargs) -> LLMEngine:
    model = str(make_tiny_model_dir_cached("llama"))
    args = dict(model=model, dtype="float32", max_model_len=256, max_num_seqs=16, enable_prefix_caching=False)
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **kwargs}), multiprocess=multiprocess)


def kv_usage(engine: LLMEngine) -> float:
    return engine.engine_core.call_utility("get_kv_cache_usage")


@pytest.fixture(scope="module")
def engine():
    engine = make_engine()
    yield engine
    engine.shutdown()


def run_until_idle(engine: LLMEngine) -> list[RequestOutput]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def oracle(engine: LLMEngine, contexts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Greedy token ids of each context sent as one stateless prompt."""
    for i, (context, p) in enumerate(zip(contexts, params, strict=True)):
        engine.add_request(f"oracle-{i}", {"prompt_token_ids": context}, p)
    finished = {o.request_id: list(o.outputs[0].token_ids) for o in run_until_idle(engine) if o.finished}
    return [finished[f"oracle-{i}"] for i in range(len(contexts))]


def run_session(engine: LLMEngine, request_id: str, chunks: list[str]) -> list[RequestOutput]:
    """Drives one session turn by turn (each chunk sent once the previous turn ended); returns each turn's last
    output, then the session's final one."""
    engine.add_request(request_id, chunks[0], turn_params(0), resumable=True)
    turns: list[RequestOutput] = []
    while True:
        for output in engine.step():
            if output.outputs[0].finish_reason is None:
                continue
            turns.append(output)
            if output.finished:
                return turns
            if len(turns) < len(chunks):
                engine.add_session_input(request_id, chunks[len(turns)], turn_params(len(turns)))
            else:
                engine.close_session_input(request_id)


def expected_contexts(tokenizer, chunks: list[str], outputs: list[list[int]]) -> list[list[int]]:
    """Each turn's context: the first chunk with special tokens, then every output and later chunk (without)."""
    contexts, context = [], list(tokenizer.encode(chunks[0]))
    for turn, chunk in enumerate(chunks):
        if turn:
            context = context + outputs[turn - 1] + tokenizer.encode(chunk, add_special_tokens=False)
        contexts.append(context)
    return contexts


def check_against_oracle(engine: LLMEngine, turns: list[RequestOutput], chunks: list[str]) -> None:
    assert [t.finished for t in turns] == [False] * len(chunks) + [True]
    outputs = [list(t.outputs[0].token_ids) for t in turns[: len(chunks)]]
    contexts = expected_contexts(engine.tokenizer, chunks, outputs)
    assert [list(t.prompt_token_ids) for t in turns[: len(chunks)]] == contexts
    assert outputs == oracle(engine, contexts, [turn_params(i) for i in range(len(chunks))])
    assert [t.outputs[0].finish_reason for t in turns] == ["length"] * (len(chunks) + 1)
    assert turns[-1].outputs[0].token_ids == []


def test_five_turns_in_process_equal_the_full_history_and_prefill_only_new_tokens(engine):
    turns = run_session(engine, "s", CHUNKS)
    check_against_oracle(engine, turns, CHUNKS)
    # Prefix caching is off: what a turn reuses is the session's own KV. It prefills its chunk and the previous
    # turn's last token (sampled, never computed).
    tokenizer = engine.tokenizer
    for turn in range(1, len(CHUNKS)):
        computed = len(turns[turn].prompt_token_ids) - turns[turn].num_cached_tokens
        assert computed == len(tokenizer.encode(CHUNKS[turn], add_special_tokens=False)) + 1
    assert kv_usage(engine) == 0.0


def test_five_turns_in_the_engine_core_process_equal_the_full_history():
    engine = make_engine(multiprocess=True, enable_prefix_caching=True)
    try:
        assert type(engine.engine_core).__name__ != "InprocClient"
        turns = run_session(engine, "s", CHUNKS)
        check_against_oracle(engine, turns, CHUNKS)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def async_llm():
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    llm = AsyncLLM(model=str(make_tiny_model_dir_cached("llama")), dtype="float32", max_model_len=256)
    yield llm
    llm.shutdown()


async def stream_session(llm, request_id: str, chunks: list[str], kind: RequestOutputKind) -> list[RequestOutput]:
    """Feeds ``chunks`` as StreamingInput, each once the previous turn ended; returns each turn's output (DELTA
    outputs folded) and the final one."""
    turn_ended = asyncio.Event()

    async def inputs():
        for turn, chunk in enumerate(chunks):
            if turn:
                await turn_ended.wait()
                turn_ended.clear()
            yield StreamingInput(chunk, turn_params(turn, kind))
        await turn_ended.wait()

    turns: list[RequestOutput] = []
    tokens: list[int] = []
    async for output in llm.generate(inputs(), None, request_id):
        completion = output.outputs[0]
        tokens = tokens + list(completion.token_ids) if kind == RequestOutputKind.DELTA else list(completion.token_ids)
        if completion.finish_reason is not None:
            completion.token_ids = tokens
            turns.append(output)
            tokens = []
            turn_ended.set()
    return turns


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_async_llm_streaming_input_equals_the_in_process_session(async_llm, engine, kind):
    turns = asyncio.run(stream_session(async_llm, f"a-{kind.name}", CHUNKS, kind))
    check_against_oracle(engine, turns, CHUNKS)


def test_chunks_sent_while_a_turn_runs_wait_for_it(engine):
    """Every chunk is sent at once: each waits in the session's queue for the turn before it."""
    engine.add_request("q", CHUNKS[0], turn_params(0), resumable=True)
    for turn in range(1, 3):
        engine.add_session_input("q", CHUNKS[turn], turn_params(turn))
    engine.close_session_input("q")
    turns = [o for o in run_until_idle(engine) if o.outputs[0].finish_reason is not None]
    assert [t.finished for t in turns] == [False, False, True]  # the input ended behind the last turn
    outputs = [list(t.outputs[0].token_ids) for t in turns]
    contexts = expected_contexts(engine.tokenizer, CHUNKS[:3], outputs)
    assert outputs == oracle(engine, contexts, [turn_params(i) for i in range(3)])


def test_a_released_session_recomputes_and_still_equals_the_oracle():
    engine = make_engine(policy_args={"session_idle_timeout_s": 0})
    try:
        turns = run_session(engine, "r", CHUNKS[:3])
        assert [t.num_cached_tokens for t in turns[:3]] == [0, 0, 0]  # released at once, no prefix cache
        check_against_oracle(engine, turns, CHUNKS[:3])
    finally:
        engine.shutdown()


def test_200_sessions_on_a_quarter_of_the_kv_they_need_all_finish_equal_to_the_oracle():
    # Each session ends at ~35 tokens (3 blocks of 16): 150 blocks hold a quarter of the 200 sessions.
    engine = make_engine(num_gpu_blocks_override=150, block_size=16, max_num_seqs=32, max_model_len=128)
    try:
        sessions = {f"p{i}": [f"Program {i} starts here", f" tool said {i % 7}", " and again"] for i in range(200)}
        turns: dict[str, list[RequestOutput]] = {sid: [] for sid in sessions}
        for sid, chunks in sessions.items():
            engine.add_request(sid, chunks[0], turn_params(0), resumable=True)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.outputs[0].finish_reason is None:
                    continue
                done = turns[output.request_id]
                done.append(output)
                if not output.finished:
                    chunks = sessions[output.request_id]
                    if len(done) < len(chunks):
                        engine.add_session_input(output.request_id, chunks[len(done)], turn_params(len(done)))
                    else:
                        engine.close_session_input(output.request_id)
        scheduler = engine.engine_core.engine_core.scheduler
        assert scheduler.session_holds.num_blocks_released_for_memory > 0  # held sessions gave way to the others
        assert all(len(t) == 4 and t[-1].finished for t in turns.values())
        contexts, params, expected_outputs = [], [], []
        for sid, chunks in sessions.items():
            outputs = [list(t.outputs[0].token_ids) for t in turns[sid][:3]]
            contexts += expected_contexts(engine.tokenizer, chunks, outputs)
            params += [turn_params(i) for i in range(3)]
            expected_outputs += outputs
        assert oracle(engine, contexts, params) == expected_outputs
        assert kv_usage(engine) == 0.0
        assert len(scheduler.session_holds) == 0 and not scheduler.requests
    finally:
        engine.shutdown()


def test_bad_session_input_fails_that_session_alone(engine):
    with pytest.raises(SessionClosedError, match="'nope' is not open"):
        engine.add_session_input("nope", "text")
    engine.add_request("plain", "Hello", turn_params(0))
    with pytest.raises(SessionClosedError):  # not a session
        engine.add_session_input("plain", "text")
    run_until_idle(engine)
    for bad, message in [
        (SamplingParams(n=2, max_tokens=2), "n > 1"),
        (SamplingParams(max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY), "FINAL_ONLY"),
        (SamplingParams(max_tokens=2, stop=["x"]), "Stop strings"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", "Hello", bad, resumable=True)
    # A chunk that overflows the context ends its session with an error; the other session goes on.
    engine.add_request("big", "Hello", turn_params(0), resumable=True)
    engine.add_request("ok", "Hello", turn_params(0), resumable=True)
    outputs = run_until_turns_end(engine, {"big", "ok"})
    engine.add_session_input("big", {"prompt_token_ids": [5] * 250}, turn_params(1))
    engine.add_session_input("ok", " more", turn_params(1))
    finals = {}
    while len(finals) < 2:
        for output in engine.step():
            if output.outputs[0].finish_reason is not None:
                finals.setdefault(output.request_id, output)
    assert finals["big"].finished and finals["big"].outputs[0].finish_reason == "error"
    assert "max_model_len" in (finals["big"].outputs[0].error or "")
    assert not finals["ok"].finished and finals["ok"].outputs[0].finish_reason == "length"
    with pytest.raises(SessionClosedError):  # finished: no more input
        engine.add_session_input("big", "again")
    engine.close_session_input("ok")
    run_until_idle(engine)
    assert outputs and kv_usage(engine) == 0.0


def run_until_turns_end(engine: LLMEngine, request_ids: set[str]) -> list[RequestOutput]:
    ended: list[RequestOutput] = []
    while {o.request_id for o in ended} != request_ids:
        ended += [o for o in engine.step() if o.outputs[0].finish_reason is not None]
    return ended


def test_aborting_a_parked_session_frees_its_kv(engine):
    engine.add_request("ab", CHUNKS[0], turn_params(0), resumable=True)
    run_until_turns_end(engine, {"ab"})
    assert kv_usage(engine) > 0.0  # parked, holding its blocks
    engine.abort_request("ab")
    assert not engine.has_unfinished_requests()
    engine.engine_core.get_output()  # one step: the scheduler reports the abort to the workers
    assert kv_usage(engine) == 0.0
    with pytest.raises(SessionClosedError):
        engine.add_session_input("ab", "more")


def test_an_unknown_session_chunk_reaching_the_engine_gets_an_error_output(engine):
    from vllite.protocol import EngineCoreRequest

    chunk = EngineCoreRequest("ghost", [1, 2], turn_params(1), None, 0.0, resumable=True, continuation=True)
    engine.engine_core.add_request(chunk)
    outputs = engine.engine_core.get_output().outputs
    assert [(o.request_id, str(o.finish_reason)) for o in outputs] == [("ghost", "error")]
    assert "not open" in (outputs[0].error or "")


def test_async_scheduling_refuses_sessions():
    engine = make_engine(async_scheduling=True)
    try:
        with pytest.raises(ValueError, match="async-scheduling"):
            engine.add_request("s", "Hello", turn_params(0), resumable=True)
    finally:
        engine.shutdown()


def test_closing_the_stream_mid_turn_aborts_the_session_and_frees_its_kv(async_llm):
    async def main() -> float:
        async def inputs():
            yield StreamingInput("Hello there", SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
            await asyncio.Event().wait()  # never more input

        stream = async_llm.generate(inputs(), None, "gone")
        async with contextlib.aclosing(stream):
            async for _ in stream:
                break  # the client goes away mid-turn
        for _ in range(200):
            usage = await async_llm.call_utility("get_kv_cache_usage")
            if usage == 0.0:
                return usage
            await asyncio.sleep(0.01)
        return usage

    assert asyncio.run(main()) == 0.0


def test_a_failing_input_stream_ends_its_session_with_that_error(async_llm):
    async def main() -> None:
        async def inputs():
            yield StreamingInput("Hello there", turn_params(0))
            yield "not a chunk"

        async for _ in async_llm.generate(inputs(), None, "broken"):
            pass

    with pytest.raises(TypeError, match="StreamingInput"):
        asyncio.run(main())


def test_an_engine_killed_mid_session_ends_each_session_stream_with_engine_dead():
    import os
    import signal

    from tests.test_async_llm import _make_llm
    from vllite.exceptions import EngineDeadError

    llm = _make_llm(step_delay_s=0.001)  # the position-token executor: no model
    try:

        async def main() -> list[BaseException | None]:
            parked = asyncio.Event()
            counted = []

            async def one(i: int) -> BaseException | None:
                async def inputs():
                    params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False)
                    yield StreamingInput({"prompt_token_ids": [1, 2, 3 + i]}, params)
                    await asyncio.Event().wait()  # the next input never comes: the session stays parked

                try:
                    async for output in llm.generate(inputs(), None, f"dead-{i}"):
                        if output.outputs[0].finish_reason is not None:
                            counted.append(i)
                            if len(counted) == 2:
                                parked.set()
                except EngineDeadError as exc:
                    return exc
                return None

            tasks = [asyncio.create_task(one(i)) for i in range(2)]
            await asyncio.wait_for(parked.wait(), 30)
            os.kill(llm.engine_core.resources.proc.pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 10)

        results = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results)
    finally:
        llm.shutdown()
