"""A request that ends while the engine sleeps, and client disconnects in general, through a real ``vllite serve``.

A request sent to a sleeping engine waits in its queue; when it ends there (its client disconnects, streaming or
not, or ``POST /abort_requests``) the engine must drop it and keep serving: after ``/wake_up`` the server answers
as before. And no client that goes away, at any point, leaves an ``ERROR`` line or a traceback in the server log.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import urllib.parse
from collections.abc import Iterator

import pytest
from http_client import HttpClient

from vllite.assets import default_model_path
from vllite.plugins.openai_server.testing import RemoteServer

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    args = [str(default_model_path()), "--served-model-name", "demo", "--max-model-len", "1024"]
    args += ["--enable-sleep-mode", "--enable-log-requests", "--disable-log-stats"]
    with RemoteServer(args, env={"VLLITE_SERVER_DEV_MODE": "1"}) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> HttpClient:
    return HttpClient(server.url)


def open_request(server: RemoteServer, body: dict) -> socket.socket:
    """Sends ``POST /v1/completions`` on a raw connection, which the caller closes to disconnect."""
    url = urllib.parse.urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port))
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_submitted(server: RemoteServer, request_id: str, start: int) -> None:
    """Waits until the server has accepted ``request_id`` (it logs the request as it submits it to the engine)."""
    server.wait_for_log(rf"Received request {re.escape(request_id)}\b", start=start)


def problems(lines: list[str]) -> list[str]:
    """The log lines that report an error: ``ERROR`` records and tracebacks."""
    return [line for line in lines if re.search(r"\bERROR\b|Traceback|Error:|Exception in ASGI", line)]


def assert_serves_after_wake_up(client: HttpClient) -> None:
    # A utility round trip first: the engine has absorbed the abort and stepped on it before it wakes up.
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    response = client.post("/wake_up")
    assert response.status_code == 200, response.text
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_client_disconnect_while_asleep_keeps_the_engine(server, client, stream):
    start = len(server.log)
    assert client.post("/sleep", params={"level": 1}).status_code == 200
    request_id = f"asleep-disconnect-{stream}"
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": stream, "request_id": request_id}
    sock = open_request(server, body)
    wait_submitted(server, request_id, start)
    sock.close()
    server.wait_for_log(rf"Aborted request\(s\) {re.escape(request_id)}-0", start=start)
    assert_serves_after_wake_up(client)
    assert problems(server.log[start:]) == []


def _read_all(client: HttpClient, body: dict, into: dict) -> None:
    if body["stream"]:
        into["lines"] = list(client.stream_lines("POST", "/v1/completions", json=body))
    else:
        into["response"] = client.post("/v1/completions", json=body)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_abort_requests_while_asleep_keeps_the_engine(server, client, stream):
    start = len(server.log)
    assert client.post("/sleep", params={"level": 1}).status_code == 200
    request_id = f"asleep-abort-{stream}"
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": stream, "request_id": request_id}
    answer: dict = {}
    reader = threading.Thread(target=_read_all, args=(client, body, answer))
    reader.start()
    wait_submitted(server, request_id, start)
    response = client.post("/abort_requests", json={"request_ids": [request_id]})
    assert response.json() == {"status": "aborted", "aborted": 1}
    reader.join(60)
    assert not reader.is_alive(), "the aborted request never ended"
    if stream:
        events = [json.loads(line[6:]) for line in answer["lines"] if line.startswith("data: {")]
        finish = [choice["finish_reason"] for event in events for choice in event["choices"]]
        assert "abort" in finish, answer
    else:
        assert answer["response"].status_code == 200, answer["response"].text
        assert answer["response"].json()["choices"][0]["finish_reason"] == "abort"
    assert_serves_after_wake_up(client)
    assert problems(server.log[start:]) == []


def test_resume_while_asleep_is_a_400_and_keeps_the_engine(server, client):
    start = len(server.log)
    assert client.post("/sleep", params={"level": 1}).status_code == 200
    response = client.post("/resume")
    assert response.status_code == 400, response.text
    assert "wake_up" in response.json()["error"]["message"]
    assert_serves_after_wake_up(client)
    assert problems(server.log[start:]) == []


def test_client_disconnects_and_aborts_leave_no_error_in_the_log(server, client):
    """Clients that leave mid-generation (streaming or not), and ``/abort_requests``, while the engine is awake."""
    start = len(server.log)
    long = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
    for index, stream in enumerate([False, True, False, True]):
        request_id = f"awake-disconnect-{index}"
        sock = open_request(server, {**long, "stream": stream, "request_id": request_id})
        wait_submitted(server, request_id, start)
        sock.close()
        server.wait_for_log(rf"Aborted request\(s\) {re.escape(request_id)}-0", start=start)
    answer: dict = {}
    body = {**long, "stream": True, "request_id": "awake-abort"}
    reader = threading.Thread(target=_read_all, args=(client, body, answer))
    reader.start()
    wait_submitted(server, "awake-abort", start)
    assert client.post("/abort_requests", json={"request_ids": ["awake-abort"]}).json()["aborted"] == 1
    reader.join(60)
    assert not reader.is_alive()
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert problems(server.log[start:]) == [], "".join(server.log[start:])
