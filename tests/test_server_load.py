"""``vllite serve`` under load and through failures: 64 concurrent streams (30% of them disconnect midway),
metrics, the engine process killed under the server, and a graceful shutdown with streams in flight."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from vllite.plugins.openai_server.testing import RemoteServer  # noqa: E402

pytestmark = pytest.mark.slow

NUM_CLIENTS = 64
NUM_DISCONNECT = 19  # 30%


def get(server, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric(server, name: str) -> float:
    """The value of an unlabelled-by-us Prometheus series (summed over its label sets)."""
    status, body = get(server, "/metrics")
    assert status == 200
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} not in /metrics"
    return sum(values)


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", "demo", "--max-model-len", "512", "--max-num-seqs", "64",
            "--num-gpu-blocks-override", "2048", "--uvicorn-log-level", "info"]  # fmt: skip
    with RemoteServer(args) as remote:
        yield remote


def prompt_of(i: int) -> str:
    return f"Client {i} says: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4])


async def _stream_tokens(client, i: int, max_tokens: int, disconnect_after: int | None) -> list[int] | None:
    stream = await client.completions.create(
        model="demo",
        prompt=prompt_of(i),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    tokens: list[int] = []
    chunks = 0
    async for chunk in stream:
        for choice in chunk.choices:
            tokens += choice.model_extra.get("token_ids") or []
        chunks += 1
        if disconnect_after is not None and chunks >= disconnect_after:
            await stream.close()
            return None
    return tokens


def test_64_concurrent_streams_with_disconnects(server):
    async def run() -> tuple[list, list]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
            whole = await asyncio.gather(
                *[
                    client.completions.create(
                        model="demo",
                        prompt=prompt_of(i),
                        max_tokens=24,
                        temperature=0,
                        extra_body={"return_token_ids": True, "ignore_eos": True},
                    )
                    for i in range(NUM_CLIENTS)
                ]
            )
            disconnecting = set(range(0, NUM_CLIENTS, NUM_CLIENTS // NUM_DISCONNECT + 1))
            while len(disconnecting) < NUM_DISCONNECT:
                disconnecting.add(max(set(range(NUM_CLIENTS)) - disconnecting))
            streamed = await asyncio.gather(
                *[
                    _stream_tokens(client, i, 480 if i in disconnecting else 24, 3 if i in disconnecting else None)
                    for i in range(NUM_CLIENTS)
                ]
            )
            return whole, streamed

    whole, streamed = asyncio.run(run())
    expected = [w.choices[0].model_extra["token_ids"] for w in whole]
    survivors = [i for i, tokens in enumerate(streamed) if tokens is not None]
    assert len(survivors) == NUM_CLIENTS - NUM_DISCONNECT
    for i in survivors:
        assert streamed[i] == expected[i], f"client {i}: stream differs from the whole response"
    # The disconnected requests (480 tokens each) were aborted in the engine: nothing runs or holds KV after.
    assert wait_for(lambda: metric(server, "vllite:num_requests_running") == 0, 10)
    assert metric(server, "vllite:num_requests_waiting") == 0
    assert metric(server, "vllite:kv_cache_usage_perc") == 0.0
    log = "".join(server.log)
    aborted = re.findall(r"Aborted request\(s\) (\S+)", log)
    assert len(aborted) == NUM_DISCONNECT, log[-2000:]
    # Still serving.
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
        assert client.completions.create(model="demo", prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_metrics_count_requests_and_tokens(server):
    before_prompt = metric(server, "vllite:prompt_tokens_total")
    before_gen = metric(server, "vllite:generation_tokens_total")
    before_e2e = metric(server, "vllite:e2e_request_latency_seconds_count")
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
        responses = [
            client.completions.create(
                model="demo", prompt=f"metrics {i}", max_tokens=5, extra_body={"ignore_eos": True}
            )
            for i in range(3)
        ]
    prompt_tokens = sum(r.usage.prompt_tokens for r in responses)
    assert metric(server, "vllite:prompt_tokens_total") - before_prompt == prompt_tokens
    assert metric(server, "vllite:generation_tokens_total") - before_gen == 15
    assert metric(server, "vllite:e2e_request_latency_seconds_count") - before_e2e == 3
    assert metric(server, "vllite:time_to_first_token_seconds_count") >= 3


def _engine_pid(server_pid: int) -> int:
    """The engine-core process: the server's child that runs multiprocessing's spawn entry point."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and "spawn_main" in cmdline:
            return int(entry)
    raise AssertionError("no engine process under the server")


def test_engine_killed_under_the_server():
    with RemoteServer(["--served-model-name", "demo", "--max-model-len", "512"]) as remote:
        client = openai.OpenAI(base_url=remote.base_url, api_key="x", max_retries=0)
        stream = client.completions.create(
            model="demo", prompt="long", max_tokens=480, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        os.kill(_engine_pid(remote.process.pid), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert wait_for(lambda: get(remote, "/health")[0] == 503, 5.0)
        assert time.monotonic() - killed < 5.0
        with pytest.raises(openai.APIStatusError) as excinfo:
            client.completions.create(model="demo", prompt="after", max_tokens=2)
        assert excinfo.value.status_code == 503
        client.close()
        assert remote.stop(timeout_s=20) is not None


def test_graceful_shutdown_ends_streams_cleanly():
    with RemoteServer(["--served-model-name", "demo", "--max-model-len", "512", "--shutdown-timeout", "0.5"]) as remote:
        client = openai.OpenAI(base_url=remote.base_url, api_key="x", max_retries=0)
        stream = client.completions.create(
            model="demo", prompt="long", max_tokens=480, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        remote.process.send_signal(signal.SIGTERM)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] in ("abort", "length")  # the stream ended with a finish, then [DONE]: no error
        assert remote.process.wait(30) == 0
        client.close()
    assert json.dumps(finish)
