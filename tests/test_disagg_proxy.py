"""Prefill/decode disaggregation over HTTP: two ``vllite serve`` processes (a ``p2p`` kv_producer and a
kv_consumer, each with its engine core in its own process) behind ``vllite disagg-proxy``, driven by the official
``openai`` client. The oracle is Hugging Face ``generate()`` (greedy, float32) on the demo model.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")

from test_executor_support import hf_greedy  # noqa: E402

from vllite.assets import default_model_path  # noqa: E402
from vllite.plugins.openai_server.disagg_proxy import UpstreamGroup, prefill_body  # noqa: E402
from vllite.plugins.openai_server.testing import RemoteServer  # noqa: E402

MODEL = "demo"
PROMPT = "Once upon a time there was a little robot who lived in a quiet town by the sea, and every morning it"
NEW_TOKENS = 8


def _kv_config(role: str, policy: str = "recompute") -> str:
    extra = {"p2p_timeout_s": 2.0, "p2p_send_timeout_s": 30.0}
    return json.dumps({"kv_connector": "p2p", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": extra})  # fmt: skip


def _server(role: str, policy: str = "recompute") -> RemoteServer:
    args = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256", "--block-size", "4"]
    return RemoteServer([*args, "--kv-transfer-config", _kv_config(role, policy)])


@pytest.fixture(scope="module")
def producer():
    with _server("kv_producer") as remote:
        yield remote


@pytest.fixture(scope="module")
def consumer():
    with _server("kv_consumer") as remote:
        yield remote


@pytest.fixture(scope="module")
def proxy(producer, consumer):
    with RemoteServer(["--prefill", producer.url, "--decode", consumer.url], command="disagg-proxy") as remote:
        yield remote


@pytest.fixture(scope="module")
def client(proxy):
    with openai.OpenAI(base_url=proxy.base_url, api_key="unused", max_retries=0) as c:
        yield c


def _expected(prompt_ids: list[int]) -> list[int]:
    return hf_greedy(default_model_path(), prompt_ids, NEW_TOKENS)


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}


def test_completion_through_the_proxy_decodes_from_received_kv(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, extra_body=GREEDY)
    [choice] = response.choices
    prompt_ids = choice.model_extra["prompt_token_ids"]
    assert choice.model_extra["token_ids"] == _expected(prompt_ids)
    assert response.usage.completion_tokens == NEW_TOKENS
    # The decode server computed only the last prompt token: the rest came from the prefill server's KV.
    assert response.usage.prompt_tokens_details.cached_tokens == len(prompt_ids) - 1


def test_streamed_completion_through_the_proxy(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT + " sang", max_tokens=NEW_TOKENS, extra_body=GREEDY)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT + " sang", max_tokens=NEW_TOKENS, stream=True, extra_body=GREEDY
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_through_the_proxy(client, consumer):
    messages = [{"role": "user", "content": PROMPT}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=NEW_TOKENS, extra_body=GREEDY
    )
    prompt_ids = response.model_extra["prompt_token_ids"]
    assert response.choices[0].model_extra["token_ids"] == _expected(prompt_ids)
    assert response.usage.prompt_tokens_details.cached_tokens == len(prompt_ids) - 1


def test_prefill_server_returns_kv_transfer_params(producer):
    status, body = _post(producer.url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert status == 200
    params = body["kv_transfer_params"]
    assert params["transfer_id"] and params["remote_address"].startswith("tcp://")
    assert params["num_tokens"] == body["usage"]["prompt_tokens"] - 1


def test_a_bad_request_is_answered_by_the_prefill_server(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=-1.0)
    assert "temperature" in str(info.value)


def test_unreachable_prefill_server_is_a_502(consumer):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    with RemoteServer(["--prefill", dead, "--decode", consumer.url], command="disagg-proxy") as lonely:
        status, body = _post(lonely.url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert status == 502
    assert "prefill server http://127.0.0.1:9" in body["error"]["message"]


def test_prefill_body_asks_for_one_unstreamed_token():
    body = prefill_body({"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {}, "min_tokens": 3}, False)
    assert body == {"prompt": "x", "max_tokens": 1, "stream": False,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}  # fmt: skip
    chat = prefill_body({"messages": [], "max_tokens": 50, "n": 2}, True)
    assert chat["max_completion_tokens"] == 1 and "max_tokens" not in chat and "n" not in chat


def test_upstream_group_picks_the_least_busy_and_rejects_bad_urls():
    group = UpstreamGroup("decode", ["http://a", "http://b"])
    first = group.pick()
    first.in_flight += 1
    assert group.pick() is not first
    with pytest.raises(ValueError, match="--prefill 'a:1'"):
        UpstreamGroup("prefill", ["a:1"])
    with pytest.raises(ValueError, match="at least one --decode"):
        UpstreamGroup("decode", [])


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_server_killed_mid_transfer(policy, consumer):
    """The prefill side dies (SIGKILL, engine core included) between handing out its KV and the decode side's
    fetch: the decode side recomputes or fails the request per its policy within 5 s, then keeps serving."""
    decode = consumer if policy == "recompute" else _server("kv_consumer", "fail")
    try:
        with _server("kv_producer") as doomed:
            status, first = _post(doomed.url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
            assert status == 200 and first["kv_transfer_params"]
            doomed.kill()
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": NEW_TOKENS, **GREEDY}
        start = time.monotonic()
        status, answer = _post(
            decode.url, "/v1/completions", {**body, "kv_transfer_params": first["kv_transfer_params"]}
        )
        assert time.monotonic() - start < 5.0
        if policy == "recompute":
            assert status == 200
            [choice] = answer["choices"]
            assert choice["token_ids"] == _expected(choice["prompt_token_ids"])
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] < len(choice["prompt_token_ids"]) - 1
        else:
            assert status == 500 and "KV" in answer["error"]["message"]
        status, plain = _post(decode.url, "/v1/completions", {**body, "prompt": "A different prompt"})
        assert status == 200
        assert plain["choices"][0]["token_ids"] == _expected(plain["choices"][0]["prompt_token_ids"])
    finally:
        if decode is not consumer:
            decode.stop()
