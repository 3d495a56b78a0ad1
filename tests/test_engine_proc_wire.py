"""The engine process's wire (issue 13): oversized frames refused before buffering, utility arguments checked against
the method's signature, CURVE-authenticated TCP sockets."""

from __future__ import annotations

import pytest
import zmq

from tests.test_engine_proc import Collector, expected_tokens, make_config, request
from vllite.exceptions import EngineClientUsageError, UtilityCallError
from vllite.protocol import EngineCoreRequestType


def _client(**kwargs):
    from vllite.plugins.engine_proc.client import SyncMPClient

    return SyncMPClient(make_config(**kwargs))


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/PID/status")


def test_oversized_frame_is_refused_before_buffering_and_the_engine_keeps_serving():
    client = _client(plugin_config={"engine_proc": {"max_frame_bytes": 8 * 1024 * 1024}})
    try:
        col = Collector(client)
        client.add_request(request("w-0", max_tokens=2))
        col.until_finished("w-0")
        pid = client.resources.proc.pid
        before = _peak_rss_kib(pid)
        big = bytearray(150 * 1024 * 1024)
        with client.resources.send_lock:
            client.resources.input_socket.send_multipart([client.core_engine, EngineCoreRequestType.ADD.value, big])
        del big
        # The engine drops the connection without buffering the frame, reconnects and serves on. A message already
        # in flight on the dropped connection is lost with it, so probe with bounded waits.
        for _ in range(5):
            try:
                assert client._send_utility("is_sleeping", ()).result(timeout=2) is False
                break
            except TimeoutError:
                continue
        else:
            raise AssertionError("the engine did not answer after refusing the oversized frame")
        client.add_request(request("w-1", max_tokens=3))
        col.until_finished("w-1")
        assert col.tokens["w-1"] == expected_tokens(4, 3)
        assert _peak_rss_kib(pid) - before < 64 * 1024  # far below the 150 MB frame
        assert not client.is_engine_dead
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def client():
    c = _client()
    yield c
    c.shutdown()


def test_client_refuses_to_send_a_message_over_the_limit():
    client = _client(plugin_config={"engine_proc": {"max_frame_bytes": 4096}})
    try:
        with pytest.raises(EngineClientUsageError, match="over max_frame_bytes=4096"):
            client.add_request(request("huge", prompt_len=5000))
        assert client.call_utility("is_sleeping") is False
    finally:
        client.shutdown()


def test_utility_arguments_are_checked_against_the_signature(client):
    from vllite.plugins.engine_proc.client import MPClient

    def raw_call(method: str, args: list) -> object:
        call_id, future = MPClient._new_utility_future(client, method)
        client._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        return future.result(timeout=10)

    with pytest.raises(UtilityCallError, match=r"Call to is_sleeping method failed: invalid arguments for is_sleeping"):
        raw_call("is_sleeping", [1, 2, 3])
    with pytest.raises(UtilityCallError, match=r"invalid arguments for pause_scheduler"):
        raw_call("pause_scheduler", ["abort", True, "extra", "more", "args"])
    assert raw_call("is_sleeping", []) is False


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
def test_tcp_sockets_refuse_a_peer_without_the_key():
    client = _client(plugin_config={"engine_proc": {"tcp_host": "127.0.0.1"}})
    ctx = zmq.Context()
    try:
        col = Collector(client)
        client.add_request(request("t-0", max_tokens=2))
        col.until_finished("t-0")
        output_address = client.resources.output_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        intruder = ctx.socket(zmq.PUSH)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.connect(output_address)
        for _ in range(3):
            intruder.send(b"ENGINE_CORE_DEAD")  # queued at the intruder: the CURVE handshake never completes
            intruder.send(b"\xc1 malformed")
        input_address = client.resources.input_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        reader = ctx.socket(zmq.DEALER)
        reader.setsockopt(zmq.LINGER, 0)
        reader.connect(input_address)
        reader.send(b"hello")
        client.add_request(request("t-1", max_tokens=3))
        col.until_finished("t-1")
        assert col.tokens["t-1"] == expected_tokens(4, 3)
        assert client.call_utility("is_sleeping") is False
        assert not client.is_engine_dead
        assert reader.poll(timeout=200) == 0  # nothing routed to a peer that could not authenticate
    finally:
        ctx.destroy(linger=0)
        client.shutdown()
