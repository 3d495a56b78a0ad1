"""vllite.protocol: enums, struct defaults, the positional wire layout, and round-trips of every struct."""

from __future__ import annotations

import gc

import msgspec
import pytest
import torch

from vllite.plugins.engine_proc.serial import MsgpackDecoder, MsgpackEncoder
from vllite.protocol import (
    FINISH_REASON_STRINGS,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineInfo,
    EngineShutdownState,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    SchedulerStats,
    UtilityOutput,
    UtilityResult,
)
from vllite.sampling_params import RequestOutputKind, SamplingParams


def wire(obj, t):
    return MsgpackDecoder(t).decode(MsgpackEncoder().encode(obj))


def test_finish_reason_strings_and_values():
    assert FINISH_REASON_STRINGS == ("stop", "length", "abort", "error", "repetition")
    for reason, text in zip(FinishReason, FINISH_REASON_STRINGS):
        assert str(reason) == text
    assert [r.value for r in FinishReason] == [0, 1, 2, 3, 4]


def test_enum_values():
    assert (EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED) == (
        1,
        2,
        3,
    )
    assert EngineCoreRequestType(b"\x03") is EngineCoreRequestType.UTILITY
    assert [m.value for m in EngineCoreRequestType] == [bytes([i]) for i in range(6)]
    assert list(EngineShutdownState) == [0, 1, 2]


def test_event_timestamps(monkeypatch):
    monkeypatch.setattr("time.monotonic", lambda: 99.0)
    assert EngineCoreEvent.new_event(EngineCoreEventType.QUEUED).timestamp == 99.0
    assert EngineCoreEvent.new_event(EngineCoreEventType.QUEUED, 12.5).timestamp == 12.5
    assert EngineCoreOutputs().timestamp == 99.0
    assert EngineCoreOutputs(timestamp=5.0).timestamp == 5.0


def test_outputs_defaults_do_not_share_lists():
    a, b = EngineCoreOutputs(), EngineCoreOutputs()
    assert a.engine_index == 0 and a.outputs == [] and a.outputs is not b.outputs
    assert a.scheduler_stats is None and a.utility_output is None and a.finished_requests is None


def test_finished_property_and_params():
    assert EngineCoreOutput("r", [1]).finished is False
    assert EngineCoreOutput("r", [1], finish_reason=FinishReason.ABORT).finished is True
    params = SamplingParams()
    assert EngineCoreRequest("r", [1], params, None, 0.0).params is params
    with pytest.raises(AssertionError):
        _ = EngineCoreRequest("r", [1], None, None, 0.0).params


def test_array_like_layout():
    assert isinstance(msgspec.msgpack.decode(msgspec.msgpack.encode(EngineCoreOutput("r", [1]))), list)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(UtilityOutput(call_id=7))) == [7, None, None]
    # missing trailing fields take their defaults
    short = msgspec.msgpack.encode(["r", [1]])
    assert msgspec.msgpack.decode(short, type=EngineCoreOutput) == EngineCoreOutput("r", [1])
    req = msgspec.msgpack.encode(["r", [1, 2], None, None, 3.0])
    assert MsgpackDecoder(EngineCoreRequest).decode(req) == EngineCoreRequest("r", [1, 2], None, None, 3.0)


def test_gc_untracked():
    for obj in (
        EngineCoreOutputs(),
        EngineCoreRequest("r", [1], None, None, 0.0),
        EngineCoreOutput("r", [1]),
        UtilityOutput(1),
    ):
        assert not gc.is_tracked(obj)


def test_engine_info_round_trips_and_is_immutable():
    info = EngineInfo(
        max_model_len=10,
        num_gpu_blocks=4,
        block_size=16,
        max_num_batched_tokens=2048,
        vocab_size=300,
        eos_token_ids=(2, 7),
        sliding_window=None,
        scheduler="Scheduler",
    )
    assert wire(info, EngineInfo) == info
    with pytest.raises(AttributeError):
        info.max_model_len = 20  # type: ignore[misc]


def test_roundtrip_engine_core_request_with_full_params():
    params = SamplingParams(
        n=3,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=11,
        stop=["x", "yz"],
        stop_token_ids=[2],
        max_tokens=20,
        min_tokens=2,
        logprobs=3,
        prompt_logprobs=1,
        output_kind=RequestOutputKind.DELTA,
        logit_bias={3: -1.0},
        allowed_token_ids=[1, 2, 3],
        extra_args={"k": [1, "v"]},
    )
    req = EngineCoreRequest(
        "r-1",
        [5, 6, 7],
        params,
        2,
        123.5,
        cache_salt="salt",
        client_index=1,
        priority=-3,
        trace_headers={"a": "b"},
    )
    out = wire(req, EngineCoreRequest)
    assert out == req
    assert out.sampling_params.output_kind is RequestOutputKind.DELTA
    assert out.sampling_params.all_stop_token_ids == [2]


def test_roundtrip_engine_core_outputs_with_everything():
    lt = LogprobsTensors(
        torch.tensor([[1, 2], [3, 4]]), torch.tensor([[-0.5, -1.0], [-0.1, -3.0]]), torch.tensor([1, 2])
    )
    big = LogprobsTensors(torch.arange(800).reshape(400, 2), torch.randn(400, 2), torch.arange(400))
    outs = EngineCoreOutputs(
        engine_index=1,
        outputs=[
            EngineCoreOutput(
                "a",
                [1],
                LogprobsLists([[1, 4]], [[-0.2, -2.5]], [1]),
                lt,
                FinishReason.LENGTH,
                None,
                [EngineCoreEvent(EngineCoreEventType.SCHEDULED, 1.0)],
                {"k": 1},
                16,
                0,
            ),
            EngineCoreOutput(
                "b",
                [2, 3],
                new_prompt_logprobs_tensors=big,
                finish_reason=FinishReason.STOP,
                stop_reason="</s>",
            ),
            EngineCoreOutput("c", [], stop_reason=7),
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25),
        timestamp=3.0,
        utility_output=UtilityOutput(5, result=UtilityResult([1, 2])),
        finished_requests={"a", "b"},
        wave_complete=2,
    )
    out = wire(outs, EngineCoreOutputs)
    assert out.finished_requests == {"a", "b"}
    assert out.outputs[0].finish_reason is FinishReason.LENGTH
    assert out.outputs[0].events[0].type is EngineCoreEventType.SCHEDULED
    assert out.outputs[1].stop_reason == "</s>" and out.outputs[2].stop_reason == 7
    for got, want in (
        (out.outputs[0].new_prompt_logprobs_tensors, lt),
        (out.outputs[1].new_prompt_logprobs_tensors, big),
    ):
        for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
            assert torch.equal(getattr(got, field), getattr(want, field))
    # everything but the tensors compares equal
    for o in (out, outs):
        for item in o.outputs:
            item.new_prompt_logprobs_tensors = None
    assert out == outs


def test_finished_requests_list_decodes_as_set():
    raw = msgspec.msgpack.encode([0, [], None, 1.0, None, ["a", "a", "b"]])
    assert MsgpackDecoder(EngineCoreOutputs).decode(raw).finished_requests == {"a", "b"}


def test_utility_output_failure_roundtrip():
    assert wire(UtilityOutput(3, failure_message="boom"), UtilityOutput) == UtilityOutput(3, "boom")
