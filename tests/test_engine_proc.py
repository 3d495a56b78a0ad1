"""The engine core in its own process: handshake, utility RPC, pause modes, aborts, hostile frames, cleanup.

A model-free executor (``PositionTokenExecutor``: token ``1000 + position``) makes every expected output known, so
these tests exercise the process plumbing only; ``test_engine_proc_faults.py`` covers deaths and shutdowns.
"""

from __future__ import annotations

import gc
import os
import random
import stat
import threading
import time
from typing import Any

import msgspec
import pytest
import zmq

from vllite.engine_args import EngineArgs
from vllite.exceptions import EngineStartupError, UtilityCallError
from vllite.protocol import EngineCoreRequest, EngineCoreRequestType, FinishReason
from vllite.sampling_params import SamplingParams

FAKE_EXECUTOR = "vllite.testing.executors:PositionTokenExecutor"


def ensure_engine_proc_plugin() -> None:
    """Registers the engine-client plugin unless it is already a builtin (idempotent)."""
    from vllite.plugin_manager import get_plugin_manager
    from vllite.plugins.engine_proc import plugin

    pm = get_plugin_manager()
    if "async_mp" not in pm.get_registry("engine_clients"):
        pm.register(plugin, "vllite.plugins.engine_proc.plugin")


def make_config(step_delay_s: float = 0.0, **kwargs: Any):
    plugin_config = kwargs.pop("plugin_config", {})
    plugin_config.setdefault("fake_executor", {"step_delay_s": step_delay_s})
    args = EngineArgs(
        executor=FAKE_EXECUTOR, skip_tokenizer_init=True, max_model_len=256, plugin_config=plugin_config, **kwargs
    )
    return args.create_engine_config()


def request(request_id: str, prompt_len: int = 4, max_tokens: int = 8, **params: Any) -> EngineCoreRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    return EngineCoreRequest(request_id, list(range(1, prompt_len + 1)), sampling, None, time.time())


def expected_tokens(prompt_len: int, n: int) -> list[int]:
    return [1000 + prompt_len + i for i in range(n)]


class Collector:
    """Reads a client's outputs, keeping tokens and finish reasons per request id."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, FinishReason] = {}
        self.errors: dict[str, str | None] = {}

    def pump(self) -> None:
        for out in self.client.get_output().outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish[out.request_id] = out.finish_reason
                self.errors[out.request_id] = out.error

    def until(self, predicate: Any, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        queued = getattr(self.client, "outputs_queue", None)
        while not predicate():
            assert time.monotonic() < deadline, "timed out waiting for engine outputs"
            if queued is not None and queued.empty():
                time.sleep(0.002)  # never block in get_output(): a stranded request must fail, not hang the run
                continue
            self.pump()

    def until_finished(self, *ids: str) -> None:
        self.until(lambda: all(i in self.finish for i in ids))

    def until_tokens(self, request_id: str, n: int = 1) -> None:
        self.until(lambda: len(self.tokens.get(request_id, ())) >= n)


@pytest.fixture(scope="module")
def client():
    from vllite.plugins.engine_proc.client import SyncMPClient

    c = SyncMPClient(make_config(step_delay_s=0.002, max_num_seqs=2, enable_sleep_mode=True))
    yield c
    c.shutdown()


@pytest.fixture
def col(client):
    yield Collector(client)
    # Leave the engine clean for the next test.
    client.call_utility("pause_scheduler", "abort")
    client.call_utility("resume_scheduler")


def test_generates_expected_tokens_and_reports_engine_facts(client, col):
    client.add_request(request("gen-a", prompt_len=5, max_tokens=6))
    client.add_request(request("gen-b", prompt_len=9, max_tokens=3))
    col.until_finished("gen-a", "gen-b")
    assert col.tokens["gen-a"] == expected_tokens(5, 6)
    assert col.tokens["gen-b"] == expected_tokens(9, 3)
    assert col.finish["gen-a"] == FinishReason.LENGTH
    assert client.engine_info.max_model_len == 256
    info = client.call_utility("get_engine_info")
    assert info["max_model_len"] == 256 and info["num_gpu_blocks"] == 256


def test_ipc_endpoints_live_in_a_private_directory(client):
    ipc_dir = client.resources.endpoints.ipc_dir
    assert ipc_dir is not None
    assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
    assert {"input", "output"} <= set(os.listdir(ipc_dir))


def test_utility_success_failure_and_allow_list(client, col):
    assert client.call_utility("is_sleeping") is False
    assert client.call_utility("get_request_counts") == [0, 0]
    with pytest.raises(UtilityCallError, match=r"^Call to sleep method failed: sleep level must be 0, 1 or 2"):
        client.call_utility("sleep", 7)
    with pytest.raises(UtilityCallError, match=r"Call to pause_scheduler method failed: Invalid pause mode"):
        client.call_utility("pause_scheduler", "bogus")
    # Refused by the client before anything is sent ...
    with pytest.raises(ValueError, match="disallowed engine utility 'shutdown'"):
        client.call_utility("shutdown")
    # ... and by the engine when a raw frame asks for it anyway.
    call_id, future = client._new_utility_future("is_sleeping")
    client._send_input(EngineCoreRequestType.UTILITY, (0, call_id, "shutdown", []))
    with pytest.raises(UtilityCallError, match="Call to shutdown method failed: 'shutdown' is not an allowed"):
        future.result(timeout=10)
    # The engine still serves.
    client.add_request(request("util-after", max_tokens=2))
    col.until_finished("util-after")
    assert col.tokens["util-after"] == expected_tokens(4, 2)


def test_request_rejected_by_the_engine_finishes_with_error(client, col):
    # The frontend validates lengths, but a request reaching the engine directly must not kill it.
    client.add_request(request("too-long", prompt_len=300, max_tokens=2))
    client.add_request(request("fine", max_tokens=2))
    col.until_finished("too-long", "fine")
    assert col.finish["too-long"] == FinishReason.ERROR
    assert str(col.finish["too-long"]) == "error"
    assert col.tokens["fine"] == expected_tokens(4, 2)


def test_request_the_engine_cannot_prepare_finishes_with_an_error_that_says_why(client, col):
    unprepared = msgspec.structs.replace(request("no-params"), sampling_params=None)
    client.add_request(unprepared)
    client.add_request(request("fine-2", max_tokens=2))
    col.until_finished("no-params", "fine-2")
    assert col.finish["no-params"] == FinishReason.ERROR
    assert "could not prepare the request" in (col.errors["no-params"] or "")
    assert col.tokens["fine-2"] == expected_tokens(4, 2)


def test_sleep_and_wake_up_round_trip(client, col):
    client.call_utility("sleep", 1)
    assert client.call_utility("is_sleeping") is True
    assert client.call_utility("is_scheduler_paused") is True
    # Scheduling alone cannot resume while the weights and KV cache sleep: a step would run on freed memory.
    with pytest.raises(UtilityCallError, match="engine is asleep"):
        client.call_utility("wake_up", ["scheduling"])
    assert client.call_utility("is_scheduler_paused") is True
    client.call_utility("wake_up", None)
    assert client.call_utility("is_scheduler_paused") is False
    assert client.call_utility("is_sleeping") is False
    client.add_request(request("after-wake", max_tokens=3))
    col.until_finished("after-wake")
    assert col.tokens["after-wake"] == expected_tokens(4, 3)


def test_pause_abort_sends_abort_outputs_and_holds_new_requests(client, col):
    client.add_request(request("pa-run", max_tokens=200))
    col.until_tokens("pa-run")
    client.call_utility("pause_scheduler", "abort")
    col.until_finished("pa-run")
    assert col.finish["pa-run"] == FinishReason.ABORT
    client.add_request(request("pa-new", max_tokens=3))
    assert client.call_utility("get_request_counts") == [0, 1]  # queued, not admitted while paused
    client.call_utility("resume_scheduler")
    col.until_finished("pa-new")
    assert col.tokens["pa-new"] == expected_tokens(4, 3)


def test_pause_wait_answers_only_after_in_flight_requests_finish(client, col):
    client.add_request(request("pw-run", max_tokens=40))
    col.until_tokens("pw-run")
    client.call_utility("pause_scheduler", "wait")  # returns once the engine has drained
    assert client.call_utility("get_request_counts") == [0, 0]
    col.until_finished("pw-run")
    assert col.tokens["pw-run"] == expected_tokens(4, 40)
    assert col.finish["pw-run"] == FinishReason.LENGTH
    client.add_request(request("pw-new", max_tokens=2))
    assert client.call_utility("get_request_counts") == [0, 1]
    client.call_utility("resume_scheduler")
    col.until_finished("pw-new")


def test_pause_keep_freezes_requests_and_resume_loses_no_tokens(client, col):
    client.add_request(request("pk-run", max_tokens=60))
    col.until_tokens("pk-run")
    client.call_utility("pause_scheduler", "keep")
    running, _ = client.call_utility("get_request_counts")
    assert running == 1
    assert client.call_utility("get_num_unfinished_requests") == 0  # frozen: the engine is idle
    client.call_utility("resume_scheduler")
    col.until_finished("pk-run")
    assert col.tokens["pk-run"] == expected_tokens(4, 60)


def test_abort_queued_and_running_requests(client, col):
    for rid in ("ab-1", "ab-2", "ab-queued"):  # max_num_seqs=2: the third waits
        client.add_request(request(rid, max_tokens=500))
    col.until(lambda: "ab-1" in col.tokens and "ab-2" in col.tokens)
    assert client.call_utility("get_request_counts") == [2, 1]
    client.abort_requests(["ab-queued"])
    assert client.call_utility("get_request_counts") == [2, 0]
    client.abort_requests(["ab-1"])
    assert client.call_utility("get_request_counts") == [1, 0]
    client.abort_requests(["ab-2", "never-existed"])
    assert client.call_utility("get_request_counts") == [0, 0]
    assert all(len(col.tokens.get(r, ())) < 500 for r in ("ab-1", "ab-2"))


def _fuzz_frames(rng: random.Random, valid: list[bytes], max_bytes: int) -> list[list[bytes]]:
    kinds = [t.value for t in EngineCoreRequestType]
    frames: list[list[bytes]] = []
    for i in range(10_000):
        choice = i % 8
        if choice == 0:  # random type byte(s) and payload
            frames.append([rng.randbytes(rng.randint(0, 3)), rng.randbytes(rng.randint(0, 64))])
        elif choice == 1:  # a valid type with random payload
            frames.append([rng.choice(kinds), rng.randbytes(rng.randint(0, 128))])
        elif choice == 2:  # truncated valid messages
            msg = rng.choice(valid)
            frames.append([msg[:1], msg[1 : rng.randint(1, len(msg) - 1)]])
        elif choice == 3:  # a single frame, or too many
            frames.append([rng.choice(kinds)] if rng.random() < 0.5 else [rng.choice(kinds)] * 5)
        elif choice == 4:  # well-formed msgpack of the wrong shape
            payload = msgspec.msgpack.encode(rng.choice([{"a": 1}, [1, 2], "x", None, [["x"], 3], (0, "id", 1, [])]))
            frames.append([rng.choice(kinds), payload])
        elif choice == 5:  # internal request types are not accepted from the wire
            frames.append([EngineCoreRequestType.EXECUTOR_FAILED.value, b""])
        elif choice == 6:  # invalid sampling params / unknown client index
            bad = request(f"bad-{i}")
            bad = msgspec.structs.replace(bad, client_index=7) if i % 16 == 6 else bad
            raw = msgspec.msgpack.encode(bad).replace(b"\xcb", b"\xc1", 1) if i % 16 != 6 else None
            frames.append([b"\x00", raw or msgspec.msgpack.encode(bad)])
        else:  # hostile utility calls
            frames.append([b"\x03", msgspec.msgpack.encode([9, 1, "sleep", [1]] if i % 2 else [0, "x", 3, 4])])
    # An oversized frame is refused by MAXMSGSIZE, which drops the connection and what was queued behind it:
    # tests/test_engine_proc_wire.py covers it on its own.
    return frames


def test_random_and_truncated_frames_leave_the_engine_serving():
    from vllite.plugins.engine_proc.client import SyncMPClient

    config = make_config(plugin_config={"engine_proc": {"max_frame_bytes": 64 * 1024}})
    client = SyncMPClient(config)
    try:
        col = Collector(client)
        valid = [b"\x00" + msgspec.msgpack.encode(request(f"v{i}")) for i in range(4)]
        valid += [b"\x01" + msgspec.msgpack.encode(["v0"]), b"\x03" + msgspec.msgpack.encode([0, 1, "is_sleeping", []])]
        socket = client.resources.input_socket
        for frames in _fuzz_frames(random.Random(7), valid, 64 * 1024):
            socket.send_multipart([client.core_engine, *frames])
        client.add_request(request("after-fuzz", prompt_len=6, max_tokens=5))
        col.until_finished("after-fuzz")
        assert col.tokens["after-fuzz"] == expected_tokens(6, 5)
        assert client.call_utility("get_request_counts") == [0, 0]
        assert client.resources.proc.is_alive()
    finally:
        client.shutdown()


def test_handshake_timeout_on_the_client_kills_the_child(monkeypatch):
    from vllite.plugins.engine_proc.client import SyncMPClient

    monkeypatch.setenv("VLLITE_ENGINE_READY_TIMEOUT_S", "1.5")
    seen: list[Any] = []
    original = SyncMPClient._wait_for_engine_startup

    def spy(self, *args):
        seen.append(self.resources)
        return original(self, *args)

    monkeypatch.setattr(SyncMPClient, "_wait_for_engine_startup", spy)
    config = make_config(plugin_config={"fake_executor": {"init_delay_s": 60}})
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="VLLITE_ENGINE_READY_TIMEOUT_S"):
        SyncMPClient(config)
    assert time.monotonic() - start < 20
    resources = seen[0]
    assert resources.closed and not resources.proc.is_alive()
    assert resources.endpoints.ipc_dir is None  # private directory removed


def test_engine_side_handshake_times_out_without_a_frontend():
    from vllite.plugins.engine_proc.core_proc import EngineCoreProc

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"\x00\x00")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(EngineStartupError, match="Did not receive response from front-end"):
            EngineCoreProc.startup_handshake(dealer, timeout_s=0.2)
        identity, hello = router.recv_multipart()
        assert identity == b"\x00\x00"
        assert msgspec.msgpack.decode(hello) == {"status": "HELLO", "local": True, "headless": False}
    finally:
        ctx.destroy(linger=0)


def test_garbage_collected_client_stops_its_engine():
    from vllite.plugins.engine_proc.client import SyncMPClient

    client = SyncMPClient(make_config())
    proc, ipc_dir = client.resources.proc, client.resources.endpoints.ipc_dir
    output_thread = client.resources.output_thread
    del client
    gc.collect()
    assert not proc.is_alive()
    assert not os.path.exists(ipc_dir)
    assert not output_thread.is_alive()
    assert threading.active_count() >= 1
