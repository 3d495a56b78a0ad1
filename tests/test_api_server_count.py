"""``vllite serve --api-server-count N`` (vLLM's ``-asc``): N API-server processes on one port and one engine process.

A real ``vllite serve -asc 2`` (demo model) answers concurrent requests from the ``openai`` client in both
processes (``x-vllite-api-server`` says which), each answer the same greedy text; ``/metrics`` from either process
counts the requests of both; a sleep asked of one process is seen by the other (one engine); SIGINT leaves no
process behind. Bad values stop the start-up before any engine starts, naming the flag.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from http_client import request

from vllite.plugins.openai_server.testing import RemoteServer

openai = pytest.importorskip("openai")

HEADER = "x-vllite-api-server"
DEV_MODE = {"VLLITE_SERVER_DEV_MODE": "1"}
PROMPT = "The quick brown fox"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served():
    server = RemoteServer(
        ["--api-server-count", "2", "--enable-sleep-mode", "--max-model-len", "256"], env=DEV_MODE, timeout_s=180
    )
    try:
        yield server
    finally:
        server.stop(90)


def _complete(client: openai.OpenAI) -> tuple[str, str, str | None, int]:
    raw = client.completions.with_raw_response.create(
        model="vllite-demo", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0
    )
    completion = raw.parse()
    choice = completion.choices[0]
    return raw.headers[HEADER], choice.text, choice.finish_reason, completion.usage.completion_tokens


def test_two_api_servers_answer_on_one_port_with_the_same_engine(served):
    reference = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    _, expected, _, _ = _complete(reference)
    answered: dict[str, int] = {}
    sent = 1
    with ThreadPoolExecutor(8) as pool:
        while len(answered) < 2 and sent < 200:  # each client its own connection: the kernel picks the process
            clients = [openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0) for _ in range(8)]
            for index, text, finish, tokens in pool.map(_complete, clients):
                assert (text, finish, tokens) == (expected, "length", MAX_TOKENS)
                answered[index] = answered.get(index, 0) + 1
            sent += len(clients)
            for client in clients:
                client.close()
    assert set(answered) == {"0", "1"}, answered

    # /metrics, from whichever process answers, counts the requests of both (prometheus multiprocess mode).
    def finished_length() -> float:
        body = request("GET", served.url + "/metrics").text
        found = re.search(r'^vllite:request_success_total\{[^}]*finished_reason="length"[^}]*\} (\S+)$', body, re.M)
        assert found, body[:2000]
        assert len(re.findall(r"^vllite:num_requests_running\{", body, re.M)) == 1  # one gauge, not one per pid
        return float(found.group(1))

    deadline = time.monotonic() + 30
    while finished_length() != sent:
        assert time.monotonic() < deadline, (finished_length(), sent)


def test_sleep_asked_of_one_api_server_is_seen_by_the_other(served):
    assert request("POST", served.url + "/sleep", params={"level": 1}).status_code == 200
    seen: dict[str, bool] = {}
    for _ in range(200):
        if len(seen) == 2:
            break
        answer = request("GET", served.url + "/is_sleeping")
        seen[answer.headers[HEADER]] = answer.json()["is_sleeping"]
    assert seen == {"0": True, "1": True}
    assert request("POST", served.url + "/wake_up").status_code == 200
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    assert _complete(client)[2:] == ("length", MAX_TOKENS)


def test_sigint_stops_every_process():
    server = RemoteServer(["-asc", "2", "--max-model-len", "256"], env=DEV_MODE, timeout_s=180)
    try:
        family = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]
        assert len(family) >= 3  # API server 0, API server 1, the engine core (and multiprocessing's helper)
    finally:
        code = server.stop(90)
    assert code == 0, "".join(server.log[-30:])
    _, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]


def _resolve(*argv: str) -> int:
    from vllite.engine_args import EngineArgs
    from vllite.plugins.openai_server.api_servers import resolve_api_server_count
    from vllite.plugins.openai_server.cli import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(list(argv))
    engine_args = EngineArgs.from_cli_args(args)
    count = resolve_api_server_count(args, engine_args)
    assert engine_args.plugin_config.get("engine_proc", {}).get("api_server_count", 1) == count
    return count


def test_api_server_count_defaults_to_one_and_takes_vllms_alias():
    assert _resolve() == 1
    assert _resolve("-asc", "3") == 3
    assert _resolve("--api-server-count", "1") == 1


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--api-server-count", "0"], {}, "--api-server-count must be >= 1, got 0"),
        (["-asc", "-2"], {}, "--api-server-count must be >= 1, got -2"),
        (["-asc", "2", "-dp", "2"], {}, "cannot be combined with --data-parallel-size 2"),
        (["-asc", "2"], {"VLLITE_ENGINE_TCP_HOST": "127.0.0.1"}, "unset VLLITE_ENGINE_TCP_HOST"),
        (["-asc", "2"], {"VLLITE_ALLOW_RUNTIME_LORA_UPDATING": "1"}, "known to one API server only"),
    ],
)
def test_bad_api_server_counts_are_refused_with_a_sentence(argv, env, message, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        _resolve(*argv)


def test_a_bad_api_server_count_stops_vllite_serve_before_the_engine_starts():
    argv = [sys.executable, "-m", "vllite.cli", "serve", "--port", "0", "--api-server-count", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--api-server-count must be >= 1, got 0" in done.stdout + done.stderr
    assert "Loading weights" not in done.stdout + done.stderr
