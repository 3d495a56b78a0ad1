"""Engine stats on the frontend: ``IterationStats`` as the ``OutputProcessor`` fills it from engine outputs, and
``AsyncLLM``'s stat loggers (a failing one must not stop the streams)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.test_engine_proc import FAKE_EXECUTOR, ensure_engine_proc_plugin, expected_tokens
from vllite.engine.output_processor import OutputProcessor
from vllite.engine.stats import FinishedRequestStats, IterationStats, RequestParamStats
from vllite.plugins.engine_proc.stat_loggers import StatLogger
from vllite.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from vllite.sampling_params import RequestOutputKind, SamplingParams

QUEUED, SCHEDULED, PREEMPTED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED


def _request(rid: str, prompt_len: int, arrival: float) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=100, detokenize=False)
    return EngineCoreRequest(rid, list(range(1, prompt_len + 1)), params, None, arrival)


def _events(*pairs: tuple[EngineCoreEventType, float]) -> list[EngineCoreEvent]:
    return [EngineCoreEvent(kind, ts) for kind, ts in pairs]


def _batch(proc: OutputProcessor, wall: float, engine_ts: float, *outputs: EngineCoreOutput) -> IterationStats:
    stats = IterationStats(iteration_timestamp=wall)
    proc.process_outputs(list(outputs), engine_core_timestamp=engine_ts, iteration_stats=stats)
    return stats


def test_iteration_stats_ttft_itl_and_finished_requests():
    proc = OutputProcessor(None, log_stats=True)
    proc.add_request(_request("a", 3, arrival=100.0), None)
    proc.add_request(_request("b", 5, arrival=100.5), None)

    # a's first token; b is still being prefilled (no output).
    it1 = _batch(proc, 101.0, 10.0, EngineCoreOutput("a", [7], events=_events((QUEUED, 9.0), (SCHEDULED, 9.5))))
    assert (it1.num_prompt_tokens, it1.num_generation_tokens, it1.num_preempted_reqs) == (3, 1, 0)
    assert it1.time_to_first_tokens_iter == [pytest.approx(1.0)]
    assert it1.inter_token_latencies_iter == [] and it1.finished_requests == []

    # a's second token; b's first, after a preemption (its first SCHEDULED counts).
    b_events = _events((QUEUED, 9.2), (SCHEDULED, 9.8), (PREEMPTED, 10.1), (SCHEDULED, 10.2))
    it2 = _batch(proc, 102.0, 10.25, EngineCoreOutput("a", [8]), EngineCoreOutput("b", [9], events=b_events))
    assert (it2.num_prompt_tokens, it2.num_generation_tokens, it2.num_preempted_reqs) == (5, 2, 1)
    assert it2.time_to_first_tokens_iter == [pytest.approx(1.5)]
    assert it2.inter_token_latencies_iter == [pytest.approx(0.25)]

    # Both finish: a with two tokens in one output (one inter-token interval), b with one.
    it3 = _batch(
        proc,
        103.0,
        10.75,
        EngineCoreOutput("a", [10, 11], finish_reason=FinishReason.LENGTH),
        EngineCoreOutput("b", [12], finish_reason=FinishReason.STOP),
    )
    assert (it3.num_prompt_tokens, it3.num_generation_tokens) == (0, 3)
    assert it3.time_to_first_tokens_iter == []
    assert it3.inter_token_latencies_iter == [pytest.approx(0.5), pytest.approx(0.5)]
    a, b = it3.finished_requests
    assert a == FinishedRequestStats(
        finish_reason="length",
        e2e_latency=pytest.approx(3.0),
        num_prompt_tokens=3,
        num_generation_tokens=4,
        queued_time=pytest.approx(0.5),
        prefill_time=pytest.approx(0.5),
        decode_time=pytest.approx(0.75),
        inference_time=pytest.approx(1.25),
        mean_time_per_output_token=pytest.approx(0.25),
        request_id="a",
        arrival_time=100.0,
        first_token_latency=pytest.approx(1.0),
        params=RequestParamStats(n=1, max_tokens=100, temperature=1.0, top_p=1.0),
    )
    assert b == FinishedRequestStats(
        finish_reason="stop",
        e2e_latency=pytest.approx(2.5),
        num_prompt_tokens=5,
        num_generation_tokens=2,
        queued_time=pytest.approx(0.6),
        prefill_time=pytest.approx(0.45),
        decode_time=pytest.approx(0.5),
        inference_time=pytest.approx(0.95),
        mean_time_per_output_token=pytest.approx(0.5),
        request_id="b",
        arrival_time=100.5,
        first_token_latency=pytest.approx(1.5),
        params=RequestParamStats(n=1, max_tokens=100, temperature=1.0, top_p=1.0),
        num_preemptions=1,  # its PREEMPTED event
    )
    assert not proc.has_unfinished_requests()


def test_request_failed_before_its_first_token_has_zero_intervals():
    proc = OutputProcessor(None, log_stats=True)
    proc.add_request(_request("e", 4, arrival=50.0), None)
    out = EngineCoreOutput("e", [], finish_reason=FinishReason.ERROR, events=_events((QUEUED, 1.0)), error="boom")
    stats = _batch(proc, 52.0, 3.0, out)
    assert (stats.num_prompt_tokens, stats.num_generation_tokens, stats.time_to_first_tokens_iter) == (0, 0, [])
    (finished,) = stats.finished_requests
    assert finished.finish_reason == "error" and finished.e2e_latency == pytest.approx(2.0)
    assert finished.num_prompt_tokens == 4 and finished.num_generation_tokens == 0
    assert (finished.queued_time, finished.prefill_time, finished.decode_time) == (0.0, 0.0, 0.0)
    assert finished.mean_time_per_output_token == 0.0


def test_iteration_stats_stay_empty_without_log_stats():
    proc = OutputProcessor(None, log_stats=False)
    proc.add_request(_request("a", 3, arrival=0.0), None)
    stats = _batch(proc, 1.0, 1.0, EngineCoreOutput("a", [7, 8], finish_reason=FinishReason.LENGTH))
    assert stats == IterationStats(iteration_timestamp=1.0)


# ---------------------------------------------------------------------------- AsyncLLM stat loggers
class RecordingLogger:
    """Sums what it is given."""

    def __init__(self, engine_info: object = None) -> None:
        self.engine_info = engine_info
        self.calls = 0
        self.scheduler_stats: list[SchedulerStats] = []
        self.generation_tokens = 0
        self.finished = 0

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None, engine_index: int = 0
    ) -> None:
        self.calls += 1
        if scheduler_stats is not None:
            self.scheduler_stats.append(scheduler_stats)
        assert iteration_stats is not None
        self.generation_tokens += iteration_stats.num_generation_tokens
        self.finished += len(iteration_stats.finished_requests)


class RaisingLogger:
    def __init__(self) -> None:
        self.calls = 0

    def record(self, scheduler_stats: object, iteration_stats: object, engine_index: int = 0) -> None:
        self.calls += 1
        raise RuntimeError("broken stat logger")


def test_a_raising_stat_logger_does_not_stop_the_streams(caplog):
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    ensure_engine_proc_plugin()
    raising = RaisingLogger()
    assert isinstance(raising, StatLogger)
    llm = AsyncLLM(
        executor=FAKE_EXECUTOR,
        skip_tokenizer_init=True,
        max_model_len=256,
        plugin_config={"fake_executor": {"step_delay_s": 0.001}},
        log_stats=False,  # stat loggers turn stats on regardless
        stat_loggers=[raising, RecordingLogger],  # an instance, and a factory taking the EngineInfo
    )
    try:
        recording = llm.stat_loggers[1]
        assert isinstance(recording, RecordingLogger) and recording.engine_info is llm.engine_info

        async def stream(i: int, prompt_len: int, max_tokens: int) -> list[int]:
            params = SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA
            )
            tokens: list[int] = []
            async for out in llm.generate({"prompt_token_ids": list(range(1, prompt_len + 1))}, params, f"r{i}"):
                tokens.extend(out.outputs[0].token_ids)
            return tokens

        async def main() -> list[list[int]]:
            return await asyncio.gather(*(stream(i, 3 + i, 6 + 2 * i) for i in range(4)))

        with caplog.at_level(logging.ERROR, logger="vllite.plugins.engine_proc.async_llm"):
            results = asyncio.run(main())
        assert results == [expected_tokens(3 + i, 6 + 2 * i) for i in range(4)]
        assert raising.calls > 1 and recording.calls == raising.calls
        failures = [r for r in caplog.records if "broken stat logger" in str(r.exc_info and r.exc_info[1])]
        assert len(failures) == 1  # logged once, not once per batch
        assert recording.generation_tokens == sum(6 + 2 * i for i in range(4)) and recording.finished == 4
        assert recording.scheduler_stats, "the engine sent no SchedulerStats: log_stats did not reach it"
        assert recording.scheduler_stats[-1].num_running_reqs == 0
    finally:
        llm.shutdown()
