"""vLLM's operations routes over plain HTTP: present only in dev mode (``VLLITE_SERVER_DEV_MODE=1`` or vLLM's
``VLLM_SERVER_DEV_MODE=1``), behind ``--api-key``, each with vLLM's method, parameters and answer, and a 400 naming
the parameter on bad input; ``/ping``, ``/load`` and default CORS on every server."""

from __future__ import annotations

import json
import threading
import time

import pytest
from http_client import HttpClient, request

from vllite.plugins.openai_server.context import ServerSettings, server_dev_mode

KEY = "ops-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPS_ROUTES = [
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
    ("POST", "/collective_rpc"),
    ("POST", "/abort_requests"),
    ("GET", "/server_info"),
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from inprocess_servers import InProcessServers

    from vllite.assets import default_model_path
    from vllite.engine_args import EngineArgs

    trace_dir = tmp_path_factory.mktemp("traces")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLITE_TORCH_PROFILER_DIR", str(trace_dir))  # the engine process inherits it
        engine_args = EngineArgs(
            model=str(default_model_path()),
            max_model_len=512,
            worker_extension_cls="vllite.testing.worker_extension:EchoWorkerExtension",
            enable_sleep_mode=True,
        )
        settings = {
            "dev": ServerSettings(
                served_model_names=("demo",), api_key=KEY, dev_mode=True, enable_server_load_tracking=True
            ),
            "plain": ServerSettings(served_model_names=("demo",), dev_mode=False),
        }
        harness = InProcessServers(engine_args, settings, metrics=True)
    harness.trace_dir = trace_dir
    try:
        yield harness
    finally:
        harness.close()


def root(servers, name: str) -> str:
    return servers.urls[name].removesuffix("/v1")


@pytest.fixture(scope="module")
def dev(servers):
    return HttpClient(root(servers, "dev"), headers=AUTH)


@pytest.fixture(scope="module")
def plain(servers):
    return HttpClient(root(servers, "plain"))


def assert_bad(response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400, error


def test_dev_mode_switch_reads_vllites_and_vllms_variable(monkeypatch):
    monkeypatch.delenv("VLLITE_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert not server_dev_mode() and not ServerSettings(served_model_names=("m",)).dev_mode
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert server_dev_mode() and ServerSettings(served_model_names=("m",)).dev_mode
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    monkeypatch.setenv("VLLITE_SERVER_DEV_MODE", "1")
    assert server_dev_mode()


@pytest.mark.parametrize(("method", "path"), OPS_ROUTES)
def test_operations_routes_are_absent_without_dev_mode(plain, method, path):
    assert plain.request(method, path).status_code == 404


@pytest.mark.parametrize(("method", "path"), OPS_ROUTES)
def test_operations_routes_need_the_api_key(servers, method, path):
    response = request(method, root(servers, "dev") + path)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "AuthenticationError"


def test_sleep_wake_up_and_is_sleeping(dev):
    assert dev.get("/is_sleeping").json() == {"is_sleeping": False}
    response = dev.post("/sleep", params={"level": 1})
    assert response.status_code == 200 and response.content == b""
    assert dev.get("/is_sleeping").json() == {"is_sleeping": True}
    assert dev.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert dev.get("/is_sleeping").json() == {"is_sleeping": True}  # the KV cache is still gone
    assert dev.post("/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
    assert dev.get("/is_sleeping").json() == {"is_sleeping": False}
    completion = dev.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3


def test_sleep_and_wake_up_set_the_engine_sleep_state_metric(dev):
    def state() -> dict[str, float]:
        lines = [line for line in dev.get("/metrics").text.splitlines() if line.startswith("vllite:engine_sleep_state")]
        return {line.split('sleep_state="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in lines}

    dev.post("/sleep", params={"level": 2})
    assert state() == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
    dev.post("/wake_up", params={"tags": "weights"})
    assert state()["awake"] == 0.0  # the KV cache is still gone
    dev.post("/wake_up")
    assert state() == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}


def test_sleep_and_wake_up_bad_parameters_name_them(dev):
    assert_bad(dev.post("/sleep", params={"level": 5}), "level")
    assert_bad(dev.post("/sleep", params={"level": "deep"}), "level")
    assert_bad(dev.post("/sleep", params={"mode": "nap"}), "mode")
    assert_bad(dev.post("/wake_up", params={"tags": "gpu"}), "tags")
    assert dev.get("/is_sleeping").json() == {"is_sleeping": False}


def test_pause_resume_and_is_paused(dev):
    assert dev.get("/is_paused").json() == {"is_paused": False}
    assert dev.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert dev.get("/is_paused").json() == {"is_paused": True}
    assert dev.post("/resume").json() == {"status": "resumed"}
    assert dev.get("/is_paused").json() == {"is_paused": False}
    assert dev.post("/pause", params={"wait_for_inflight_requests": "true"}).json() == {"status": "paused"}
    assert dev.post("/resume").json() == {"status": "resumed"}
    assert_bad(dev.post("/pause", params={"mode": "later"}), "mode")
    assert_bad(dev.post("/pause", params={"clear_cache": "maybe"}), "clear_cache")
    assert dev.get("/is_paused").json() == {"is_paused": False}


def test_reset_prefix_cache(dev):
    assert dev.post("/reset_prefix_cache").json() == {"success": True}
    assert dev.post("/reset_prefix_cache", params={"reset_running_requests": "true"}).json() == {"success": True}
    assert_bad(dev.post("/reset_prefix_cache", params={"reset_external": "true"}), "reset_external")
    assert_bad(
        dev.post("/reset_prefix_cache", params={"reset_running_requests": "sometimes"}), "reset_running_requests"
    )


def test_start_and_stop_profile_write_a_trace(servers, dev):
    assert dev.post("/start_profile").status_code == 200
    assert_bad(dev.post("/start_profile"), "profiler")  # already running
    assert dev.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
    response = dev.post("/stop_profile")
    assert response.status_code == 200 and response.content == b""
    assert len(list(servers.trace_dir.glob("*.pt.trace.json.gz"))) == 1
    assert_bad(dev.post("/stop_profile"), "profiler")  # not running


def test_collective_rpc_calls_every_worker(dev):
    body = {"method": "echo_args_kwargs", "args": [1, "a"], "kwargs": {"k": [2]}, "timeout": 30}
    assert dev.post("/collective_rpc", json=body).json() == {"results": [{"args": [1, "a"], "kwargs": {"k": [2]}}]}
    assert dev.post("/collective_rpc", json={"method": "return_none"}).json() == {"results": [None]}
    # vLLM's answer: a result that is not null, an object or an array comes back as its string
    assert dev.post("/collective_rpc", json={"method": "model_max_len"}).json() == {"results": ["512"]}


def test_collective_rpc_bad_input_names_the_field(dev):
    assert_bad(dev.post("/collective_rpc", json={}), "method")
    assert_bad(dev.post("/collective_rpc", json={"method": "no_such_method"}), "method")
    assert_bad(dev.post("/collective_rpc", json={"method": "_sleep"}), "method")
    assert_bad(dev.post("/collective_rpc", json={"method": "check_health", "timeout": -1}), "timeout")
    assert_bad(dev.post("/collective_rpc", json={"method": "check_health", "args": "x"}), "args")
    assert_bad(dev.post("/collective_rpc", json={"method": "check_health", "pickle": "x"}), "pickle")


def _stream_until_aborted(base_url: str, body: dict, events: list) -> None:
    for line in HttpClient(base_url, headers=AUTH).stream_lines("POST", "/v1/completions", json=body):
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))


def test_abort_requests_by_response_id(servers, dev):
    body = {"prompt": "Once", "max_tokens": 400, "stream": True, "request_id": "long-1", "ignore_eos": True}
    events: list = []
    worker = threading.Thread(target=_stream_until_aborted, args=(root(servers, "dev"), body, events))
    worker.start()
    deadline = time.monotonic() + 30
    while not events and time.monotonic() < deadline:
        time.sleep(0.02)
    assert events, "the stream did not start"
    assert dev.post("/abort_requests", json={"request_ids": ["long-1"]}).json() == {"status": "aborted", "aborted": 1}
    worker.join(30)
    finish = [choice["finish_reason"] for event in events for choice in event["choices"] if choice["finish_reason"]]
    assert finish == ["abort"]
    assert sum(1 for event in events for _ in event["choices"]) < 400


def test_abort_requests_without_ids_aborts_everything_in_flight(dev):
    assert dev.post("/abort_requests", json={}).json() == {"status": "aborted", "aborted": 0}
    assert_bad(dev.post("/abort_requests", json={"request_ids": "long-1"}), "request_ids")


def test_server_info_in_vllms_shape(dev, monkeypatch):
    monkeypatch.setenv("VLLM_SOME_SETTING", "on")  # the server runs in this process: it reads this environment
    monkeypatch.setenv("VLLITE_API_KEY", "secret")
    text = dev.get("/server_info").json()
    assert set(text) == {"vllm_config", "vllm_env", "system_env"}
    assert isinstance(text["vllm_config"], str) and "max_model_len" in text["vllm_config"]
    assert text["vllm_env"]["VLLM_SOME_SETTING"] == "on" and "VLLITE_API_KEY" not in text["vllm_env"]
    assert text["system_env"]["torch_version"]
    structured = dev.get("/server_info", params={"config_format": "json"}).json()
    assert structured["vllm_config"]["model_config"]["max_model_len"] == 512
    assert_bad(dev.get("/server_info", params={"config_format": "yaml"}), "config_format")


def test_server_info_shows_the_dtype_auto_resolved_to(dev):
    """``--dtype auto`` (the default) is resolved once, where the model loads; /server_info shows that value."""
    import torch

    from vllite.assets import default_model_path
    from vllite.model_files import load_hf_config
    from vllite.plugins.transformers_executor.model_loader import resolve_dtype

    resolved = resolve_dtype("auto", load_hf_config(str(default_model_path())), torch.device("cpu"))
    expected = str(resolved).removeprefix("torch.")
    structured = dev.get("/server_info", params={"config_format": "json"}).json()
    assert structured["vllm_config"]["model_config"]["dtype"] == expected
    text = dev.get("/server_info").json()["vllm_config"]
    assert f" dtype='{expected}'" in text and " dtype='auto'" not in text, text  # not kv_cache_dtype='auto'


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_like_health_without_a_key(servers, method):
    response = request(method, root(servers, "dev") + "/ping")
    assert response.status_code == 200 and response.content == b""


def test_load_counts_requests_in_flight(servers, dev, plain):
    assert plain.get("/load").json() == {"server_load": 0}  # not tracked there
    assert dev.get("/load").json() == {"server_load": 0}
    body = {"prompt": "Once", "max_tokens": 300, "stream": True, "ignore_eos": True, "request_id": "load-1"}
    events: list = []
    worker = threading.Thread(target=_stream_until_aborted, args=(root(servers, "dev"), body, events))
    worker.start()
    deadline = time.monotonic() + 30
    while not events and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dev.get("/load").json() == {"server_load": 1}
    dev.post("/abort_requests", json={"request_ids": ["load-1"]})
    worker.join(30)
    deadline = time.monotonic() + 10
    while dev.get("/load").json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dev.get("/load").json() == {"server_load": 0}


def test_default_cors_allows_every_origin(plain):
    response = plain.get("/v1/models", headers={"Origin": "https://dashboard.example"})
    assert response.headers["access-control-allow-origin"] == "*"
    preflight = plain.options(
        "/v1/chat/completions",
        headers={"Origin": "https://x.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"


def test_invocations_dispatches_by_body_shape(dev):
    chat = dev.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert chat.json()["usage"]["completion_tokens"] <= 3
    completion = dev.post("/invocations", json={"prompt": "Once upon", "max_tokens": 3, "temperature": 0})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    direct = dev.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 3, "temperature": 0})
    assert completion.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]


def test_invocations_streams(dev):
    lines = list(
        HttpClient(dev.base_url, headers=AUTH).stream_lines(
            "POST", "/invocations", json={"prompt": "Once", "max_tokens": 4, "stream": True}
        )
    )
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"


def test_invocations_bad_bodies(servers, dev):
    assert_bad(dev.post("/invocations", json={"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
               "temperature")  # fmt: skip
    assert_bad(dev.post("/invocations", json={"prompt": "x", "max_tokens": -1}), "max_tokens")
    nothing = dev.post("/invocations", json={"question": "?"})
    assert nothing.status_code == 400
    assert "ChatCompletionRequest" in nothing.json()["error"]["message"]
    not_json = dev.post("/invocations", headers={"Content-Type": "text/plain"})
    assert_bad(not_json, "Content-Type")
    assert request("POST", root(servers, "dev") + "/invocations", json={"prompt": "x"}).status_code == 401
