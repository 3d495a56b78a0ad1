"""Bad requests to ``vllite serve``: each gets the right status and an OpenAI error object naming the problem
(never a traceback), and the server keeps serving."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

import pytest

from vllite.plugins.openai_server.testing import FORCED_SEQUENCE, RemoteServer

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
MAX_LOG_LEN = 8
JSON = "application/json"


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", "demo", "--api-key", KEY, "--max-model-len", "128"]
    args += ["--enable-log-requests", "--max-log-len", str(MAX_LOG_LEN)]
    with RemoteServer([*args, "--logits-processors", FORCED_SEQUENCE]) as remote:
        yield remote


def call(server, method: str, path: str, body=None, headers=AUTH, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": JSON, **headers}
    request = urllib.request.Request(server.url + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def completion(**fields):
    return {"model": "demo", "prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields):
    return {"model": "demo", "messages": USER, "max_tokens": 2, **fields}


CASES = [
    # (id, path, body, status, what the message must name)
    ("temperature-type", "/v1/completions", completion(temperature="hot"), 400, "temperature"),
    ("temperature-range", "/v1/completions", completion(temperature=-1), 400, "temperature"),
    ("top_p-range", "/v1/completions", completion(top_p=0), 400, "top_p"),
    ("max_tokens-negative", "/v1/completions", completion(max_tokens=-5), 400, "max_tokens"),
    ("n-zero", "/v1/completions", completion(n=0), 400, "n"),
    ("unknown-field", "/v1/completions", completion(foo=1), 400, "foo"),
    ("missing-prompt", "/v1/completions", {"model": "demo"}, 400, "prompt"),
    ("empty-prompt-list", "/v1/completions", completion(prompt=[]), 400, "prompt"),
    ("prompt-too-long", "/v1/completions", completion(prompt="word " * 400), 400, "maximum model length"),
    ("token-out-of-vocab", "/v1/completions", completion(prompt=[1, 99999999]), 400, "vocabulary"),
    ("logprobs-too-many", "/v1/completions", completion(logprobs=100), 400, "logprobs"),
    ("best_of", "/v1/completions", completion(best_of=3), 400, "best_of"),
    ("stream_options-without-stream", "/v1/completions", completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("logit_bias-key", "/v1/completions", completion(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("xargs-value", "/v1/completions", completion(vllm_xargs={"a": {"b": 1}}), 400, "vllm_xargs"),
    ("plugin-rejects-arg", "/v1/completions", completion(vllm_xargs={"forced_token_ids": "abc"}), 400,
     "forced_token_ids"),
    ("unknown-model", "/v1/completions", completion(model="gpt-9"), 404, "gpt-9"),
    ("missing-messages", "/v1/chat/completions", {"model": "demo"}, 400, "messages"),
    ("empty-messages", "/v1/chat/completions", chat(messages=[]), 400, "messages"),
    # Any role string reaches the chat template (vLLM's behaviour); a role that is not a string is still refused.
    ("bad-role", "/v1/chat/completions", chat(messages=[{"role": 5, "content": "x"}]), 400, "role"),
    ("image-part", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "text"),
    ("top_logprobs-alone", "/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs"),
    ("response_format", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {}}),
     400, "response_format"),
    ("tool-schema", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
          tool_choice="none"), 400, "parameters"),
    ("tool-name", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "bad name!"}}], tool_choice="none"), 400, "name"),
    ("auto-without-parser", "/v1/chat/completions", chat(tools=[TOOL]), 400, "--tool-call-parser"),
    ("unknown-function", "/v1/chat/completions",
     chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), 400, "'g'"),
    ("tool_choice-without-tools", "/v1/chat/completions", chat(tool_choice="required"), 400, "tools"),
    ("request-chat-template", "/v1/chat/completions", chat(chat_template="{{ x }}"), 400,
     "--trust-request-chat-template"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "named"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_is_named(server, path, body, status, named):
    got, raw = call(server, "POST", path, body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert error["code"] == status
    assert named in error["message"] or named == error["param"], error
    assert "Traceback" not in raw.decode()


def test_invalid_json_says_where(server):
    status, raw = call(server, "POST", "/v1/completions", raw=b'{"prompt": ')
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] is None, error
    assert error["message"] == "The request body is not valid JSON: Expecting value at character 11.", error


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_body_without_the_json_content_type_is_named(server, content_type):
    connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}  # none at all: not even urllib's
    connection.request("POST", "/v1/completions", json.dumps(completion()).encode(), headers)
    response = connection.getresponse()
    status, error = response.status, json.loads(response.read())["error"]
    connection.close()
    assert status == 400 and error["param"] is None, error
    shown = content_type or "none"
    assert error["message"] == (
        f"The request body must be JSON sent with 'Content-Type: application/json' (got Content-Type: {shown})."
    ), error


@pytest.mark.parametrize(
    ("path", "body", "param", "prompt_tokens"),
    [
        ("/v1/completions", completion(prompt=[1, 2, 3], max_tokens=126), "max_tokens", 3),
        ("/v1/completions", completion(prompt=[[1, 2], [1, 2, 3, 4]], max_tokens=125), "max_tokens", 4),
        ("/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=1000), "max_completion_tokens", None),
        ("/v1/chat/completions", chat(max_tokens=1000), "max_tokens", None),
    ],
    ids=["completion", "several-prompts", "max_completion_tokens", "chat-max_tokens"],
)
def test_max_tokens_beyond_the_context_is_400_naming_both(server, path, body, param, prompt_tokens):
    status, raw = call(server, "POST", path, body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, error
    requested = body.get(param)
    if prompt_tokens is None:
        prompt_tokens = json.loads(call(server, "POST", "/tokenize", {"model": "demo", "messages": USER})[1])["count"]
    assert error["message"] == (
        f"{param}={requested} is too large: this model's maximum context length is 128 tokens, and the prompt takes "
        f"{prompt_tokens} of them, which leaves {128 - prompt_tokens} for the completion. Lower {param} or shorten "
        "the prompt."
    ), error


def test_max_tokens_that_fill_the_context_exactly_are_served(server):
    status, raw = call(server, "POST", "/v1/completions", completion(prompt=[1, 2, 3], max_tokens=125, ignore_eos=True))
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 125, raw
    truncated = completion(prompt=list(range(5, 105)), max_tokens=100, truncate_prompt_tokens=28, ignore_eos=True)
    status, raw = call(server, "POST", "/v1/completions", truncated)  # the prompt counts after truncation
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 100, raw


def test_an_unknown_model_lists_the_served_names(server):
    status, raw = call(server, "POST", "/v1/completions", completion(model="gpt-9"))
    error = json.loads(raw)["error"]
    assert status == 404 and error["param"] == "model"
    assert error["message"] == "The model `gpt-9` does not exist. This server serves: demo.", error


def test_a_data_parallel_rank_out_of_range_names_the_header(server):
    status, raw = call(server, "POST", "/v1/completions", completion(), headers={**AUTH, "X-data-parallel-rank": "3"})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "X-data-parallel-rank", error
    assert "data_parallel_rank" in error["message"] and "3" in error["message"]


def test_auto_tool_choice_asks_only_for_a_parser(server):
    status, raw = call(server, "POST", "/v1/chat/completions", chat(tools=[TOOL]))
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "tool_choice"
    assert "--tool-call-parser" in error["message"] and "--enable-auto-tool-choice" not in error["message"], error


def test_max_log_len_cuts_each_logged_prompt(server):
    prompt = "abcdefghijklmnopqrstuvwxyz"
    status, _ = call(server, "POST", "/v1/completions", completion(prompt=[prompt, "0123456789abcdef"], max_tokens=1))
    assert status == 200
    deadline = time.monotonic() + 10
    while not (lines := [line for line in server.log if "Received request" in line and "abcdefgh" in line]):
        assert time.monotonic() < deadline, "".join(server.log[-20:])
        time.sleep(0.1)
    assert "prompt: ['abcdefgh', '01234567']," in lines[-1] and "abcdefghi" not in lines[-1], lines[-1]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_bad_key_is_401_on_every_v1_route(server, headers):
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", completion())]:
        status, raw = call(server, method, path, body, headers=headers)
        assert status == 401 and "API key" in json.loads(raw)["error"]["message"]


def test_unknown_route_is_404_json(server):
    status, raw = call(server, "GET", "/v1/nothing-here")
    assert status == 404 and json.loads(raw)["error"]["code"] == 404


def test_still_serving_after_bad_requests(server):
    for _, path, body, _, _ in CASES:
        call(server, "POST", path, body)
    status, raw = call(server, "POST", "/v1/completions", completion(max_tokens=3, temperature=0))
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    assert call(server, "GET", "/health", headers={})[0] == 200
    assert call(server, "GET", "/v1/models", headers={})[0] == 401
    assert call(server, "GET", "/version", headers={})[0] == 200
