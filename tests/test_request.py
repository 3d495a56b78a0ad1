"""vllite.request.Request: token streams, block-hash callback, heap order, lifecycle, construction."""

from __future__ import annotations

import heapq

import pytest

from vllite.lora import LoRARequest
from vllite.protocol import EngineCoreEventType, EngineCoreRequest, FinishReason
from vllite.request import Request, RequestStatus
from vllite.sampling_params import SamplingParams

BLOCK = 4


def full_block_hasher(request: Request) -> list[bytes]:
    """Hashes each block that became full since the last call (a stand-in for vllite.kv_cache's hasher)."""
    start = len(request.block_hashes)
    full = request.num_tokens // BLOCK
    return [bytes(request.all_token_ids[i * BLOCK : (i + 1) * BLOCK]) for i in range(start, full)]


def make(rid="r", prompt=(1, 2, 3), **kw) -> Request:
    return Request(rid, list(prompt), kw.pop("params", SamplingParams(max_tokens=8)), **kw)


def test_token_counts_and_append():
    r = make(prompt=[1, 2, 3])
    assert (r.num_prompt_tokens, r.num_tokens, r.num_output_tokens) == (3, 3, 0)
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6])
    assert r.output_token_ids == [4, 5, 6]
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert (r.num_tokens, r.num_output_tokens, r.num_prompt_tokens) == (6, 3, 3)
    r.spec_token_ids = [7, 8]
    assert r.num_tokens_with_spec == 8 and r.num_tokens == 6
    assert r.max_tokens == 8


def test_prompt_is_copied():
    prompt = [1, 2]
    r = Request("r", prompt, SamplingParams())
    r.append_output_token_ids(3)
    assert prompt == [1, 2] and r.prompt_token_ids == [1, 2]


def test_max_tokens_none_means_unbounded():
    assert make(params=SamplingParams(max_tokens=None)).max_tokens > 1 << 40


def test_block_hasher_hashes_each_full_block_once():
    calls = []

    def hasher(req):
        calls.append(req.num_tokens)
        return full_block_hasher(req)

    r = make(prompt=[1, 2, 3, 4, 5, 6], block_hasher=hasher)
    assert r.block_hashes == [bytes([1, 2, 3, 4])]
    r.append_output_token_ids(7)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([8, 9, 10, 11, 12])
    assert r.block_hashes == [bytes([1, 2, 3, 4]), bytes([5, 6, 7, 8]), bytes([9, 10, 11, 12])]
    assert calls == [6, 7, 12]


def test_no_hasher_no_hashes():
    r = make(prompt=list(range(20)))
    r.append_output_token_ids([1, 2, 3, 4])
    assert r.block_hashes == []


def test_ordering_priority_then_arrival_then_id():
    a = make("a", priority=1, arrival_time=1.0)
    b = make("b", priority=0, arrival_time=5.0)
    c = make("c", priority=0, arrival_time=2.0)
    d = make("d", priority=0, arrival_time=2.0)
    assert b < a and c < b and c < d and not d < c
    heap: list[Request] = []
    for r in (a, b, d, c):
        heapq.heappush(heap, r)
    assert [heapq.heappop(heap).request_id for _ in range(4)] == ["c", "d", "b", "a"]


def test_ordering_total_for_identical_keys():
    x, y = make("same"), make("same")
    assert (x < y) != (y < x)


def test_from_engine_core_request():
    params = SamplingParams(max_tokens=5, stop_token_ids=[9])
    ecr = EngineCoreRequest(
        "id-1",
        [4, 5, 6, 7, 8],
        params,
        2,
        12.5,
        lora_request=LoRARequest("l", 7, "/adapters/l"),
        cache_salt="s",
        client_index=3,
        priority=-1,
        trace_headers={"t": "1"},
    )
    r = Request.from_engine_core_request(ecr, block_hasher=full_block_hasher)
    assert r.request_id == "id-1" and r.prompt_token_ids == [4, 5, 6, 7, 8]
    assert r.sampling_params is params and r.eos_token_id == 2 and r.arrival_time == 12.5
    assert (r.client_index, r.priority, r.cache_salt, r.lora_name) == (3, -1, "s", "l")
    assert r.trace_headers == {"t": "1"}
    assert r.block_hashes == [bytes([4, 5, 6, 7])]
    assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 and r.max_tokens == 5


def test_from_engine_core_request_without_params():
    with pytest.raises(ValueError, match="id-2"):
        Request.from_engine_core_request(EngineCoreRequest("id-2", [1], None, None, 0.0))


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (RequestStatus.FINISHED_STOPPED, FinishReason.STOP),
        (RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH),
        (RequestStatus.FINISHED_ABORTED, FinishReason.ABORT),
        (RequestStatus.FINISHED_IGNORED, FinishReason.LENGTH),
        (RequestStatus.FINISHED_ERROR, FinishReason.ERROR),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PREEMPTED, None),
    ],
)
def test_status_and_finish_reason(status, reason):
    r = make()
    r.status = status
    assert r.is_finished() is (reason is not None)
    assert r.get_finished_reason() == reason


def test_events_are_taken_once():
    r = make()
    assert r.take_events() is None
    r.record_event(EngineCoreEventType.QUEUED, 1.0)
    r.record_event(EngineCoreEventType.SCHEDULED)
    events = r.take_events()
    assert [e.type for e in events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert events[0].timestamp == 1.0
    assert r.take_events() is None


def test_repr_mentions_id_and_status():
    assert "r" in repr(make()) and "WAITING" in repr(make())
