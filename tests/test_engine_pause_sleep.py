"""Pause, sleep and resume mean the same in-process and in the engine process: one script, identical results.

The script drives ``LLMEngine`` through every pause mode and sleep with requests in flight. The engine process
runs its busy loop on its own, so only what both must agree on is recorded: each request's finish reason, its
tokens (exactly, or as a correct prefix when a pause cut it short), and the paused / sleeping flags.
"""

from __future__ import annotations

import pytest

from vllite.engine.llm_engine import LLMEngine
from vllite.engine_args import EngineArgs
from vllite.sampling_params import SamplingParams

FAKE_EXECUTOR = "vllite.testing.executors:PositionTokenExecutor"
TOKEN_BASE = 1000


def make_engine(multiprocess: bool) -> LLMEngine:
    config = EngineArgs(
        executor=FAKE_EXECUTOR,
        skip_tokenizer_init=True,
        max_model_len=4096,
        block_size=4,
        num_gpu_blocks_override=2048,
        plugin_config={"fake_executor": {"step_delay_s": 0.001}},
        enable_sleep_mode=True,
    ).create_engine_config()
    return LLMEngine(config, multiprocess=multiprocess)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def finish(engine: LLMEngine) -> dict[str, tuple[str | None, bool, int]]:
    """Steps until every request finished: ``{id: (finish_reason, tokens are the expected prefix, count)}``."""
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                completion = out.outputs[0]
                start = len(out.prompt_token_ids or ())
                expected = [TOKEN_BASE + start + i for i in range(len(completion.token_ids))]
                results[out.request_id] = (
                    completion.finish_reason,
                    completion.token_ids == expected,
                    len(completion.token_ids),
                )
    return results


def first_output(engine: LLMEngine) -> None:
    """Steps until the engine produced something: the request is in flight."""
    while not engine.step():
        pass


def script(engine: LLMEngine) -> list[object]:
    log: list[object] = []
    # wait: running requests finish, then the engine is paused; a request added meanwhile waits for resume.
    engine.add_request("a", [1, 2, 3], params(6))
    engine.add_request("b", [4, 5], params(6))
    first_output(engine)
    engine.pause_scheduler("wait")
    log += ["wait", engine.is_scheduler_paused(), finish(engine)]
    engine.add_request("c", [7], params(4))
    log.append(engine.engine_core.call_utility("get_request_counts"))
    engine.resume_scheduler()
    log += [engine.is_scheduler_paused(), finish(engine)]
    # abort: in-flight requests end with "abort" (tokens so far are a correct prefix).
    engine.add_request("d", [1], params(4000))
    first_output(engine)
    engine.pause_scheduler("abort")
    aborted = finish(engine)
    log += ["abort", {rid: result[:2] for rid, result in aborted.items()}, engine.is_scheduler_paused()]
    engine.resume_scheduler()
    # keep: frozen in place, then resumed without losing a token.
    engine.add_request("e", [2, 3], params(8))
    first_output(engine)
    engine.pause_scheduler("keep")
    log += ["keep", engine.is_scheduler_paused()]
    engine.resume_scheduler()
    log.append(finish(engine))
    # sleep (mode wait): the request in flight finishes first; asleep and paused until woken.
    engine.add_request("f", [5], params(5))
    first_output(engine)
    engine.sleep(1, "wait")
    log += ["sleep", engine.is_sleeping(), engine.is_scheduler_paused(), finish(engine)]
    engine.wake_up()
    log += [engine.is_sleeping(), engine.is_scheduler_paused()]
    # sleep (mode abort, the default): in-flight work is aborted; after waking, generation is unchanged.
    engine.add_request("g", [6], params(4000))
    first_output(engine)
    engine.sleep(1)
    log += ["sleep-abort", {rid: result[:2] for rid, result in finish(engine).items()}, engine.is_sleeping()]
    engine.wake_up()
    engine.add_request("h", [1, 2, 3], params(6))
    log += [engine.is_sleeping(), finish(engine)]
    return log


def run_script(multiprocess: bool) -> list[object]:
    engine = make_engine(multiprocess)
    try:
        return script(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def in_process() -> list[object]:
    return run_script(multiprocess=False)


def test_in_process_script_has_vllm_pause_and_sleep_semantics(in_process):
    full = ("length", True)
    assert in_process[:3] == ["wait", True, {"a": (*full, 6), "b": (*full, 6)}]
    assert in_process[3] in ([0, 1], (0, 1))  # queued while paused
    assert in_process[4:6] == [False, {"c": (*full, 4)}]
    assert in_process[6:9] == ["abort", {"d": ("abort", True)}, True]
    assert in_process[9:12] == ["keep", True, {"e": (*full, 8)}]
    assert in_process[12:18] == ["sleep", True, True, {"f": (*full, 5)}, False, False]
    assert in_process[18:] == ["sleep-abort", {"g": ("abort", True)}, True, False, {"h": (*full, 6)}]


def test_engine_process_gives_identical_results(in_process):
    in_engine_process = run_script(multiprocess=True)
    normalized = [list(x) if isinstance(x, tuple) else x for x in in_process]
    assert [list(x) if isinstance(x, tuple) else x for x in in_engine_process] == normalized
