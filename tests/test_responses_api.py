"""``/v1/responses`` end to end, driven by the official ``openai`` client: one demo-model engine serves one app per
model family (its chat template, tool and reasoning parsers, ``parser_families``) while a logits processor forces the
family's exact output. Checked: reasoning, function calls and text, whole and streamed (the events add up to the
whole response); the two-turn tool loop by sending the items back and by ``previous_response_id``; retrieve, delete,
``store: false``, background responses and cancel; ``text.format`` json_schema; bad requests (400 / 404 in OpenAI's
error shape); ``--api-key``; metrics; a client that goes away aborts its request.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from parser_families import FAMILIES, TOOLS, Family, Turn, forced, start_family_servers  # noqa: E402

from vllite.assets import default_model_path  # noqa: E402

MODEL = "demo"
KEY = "s3cret"
USER = {"role": "user", "content": "Weather in Paris?"}
RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def servers():
    harness = start_family_servers(MODEL, auth=("qwen3", KEY), metrics=True)
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def clients(servers):
    made = {name: openai.OpenAI(base_url=url, api_key="unused", max_retries=0) for name, url in servers.urls.items()}
    yield made
    for client in made.values():
        client.close()


@pytest.fixture(scope="module")
def tokenizer():
    from vllite.engine.tokenizer import get_tokenizer

    return get_tokenizer(default_model_path())


def request(family: Family, tokenizer, turn: Turn, input, **extra) -> dict:
    body = {"vllm_xargs": {"forced_token_ids": forced(tokenizer, turn.pieces)}, **extra.pop("extra_body", {})}
    if family.template_kwargs:
        body["chat_template_kwargs"] = family.template_kwargs
    return dict(model=MODEL, input=input, tools=RESPONSE_TOOLS, extra_body=body, **extra)


def summary(response) -> tuple[str, str, tuple]:
    """``(reasoning, text, calls)`` of a response, checking each item's type on the way."""
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseReasoningItem

    reasoning, calls = "", []
    for item in response.output:
        if item.type == "reasoning":
            assert isinstance(item, ResponseReasoningItem) and item.id.startswith("rs_")
            reasoning += "".join(part.text for part in item.content or [])
        elif item.type == "function_call":
            assert isinstance(item, ResponseFunctionToolCall) and item.id.startswith("fc_") and item.call_id
            calls.append((item.name, json.loads(item.arguments)))
        else:
            assert isinstance(item, ResponseOutputMessage) and item.role == "assistant" and item.id.startswith("msg_")
    return reasoning, response.output_text, tuple(calls)


def expected(turn: Turn) -> tuple[str, str, tuple]:
    return turn.reasoning or "", turn.content or "", turn.calls


def collect_events(events) -> tuple[list, object, dict]:
    """The events, the final response, and what the deltas add up to per item id."""
    events = list(events)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    deltas: dict[str, str] = {}
    for event in events:
        if event.type.endswith(".delta"):
            deltas[event.item_id] = deltas.get(event.item_id, "") + event.delta
    return events, events[-1].response, deltas


def check_stream_adds_up(events, final, deltas) -> None:
    done = {event.item.id: event.item for event in events if event.type == "response.output_item.done"}
    assert [item.id for item in final.output] == list(done)
    for item in final.output:
        if item.type == "message":
            assert deltas.get(item.id, "") == item.content[0].text
        elif item.type == "reasoning":
            assert deltas[item.id] == item.content[0].text
        else:
            assert deltas[item.id] == item.arguments


def base_url(servers, name: str) -> str:
    return servers.urls[name].removesuffix("/v1")


def call(servers, name: str, method: str, path: str, body=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(base_url(servers, name) + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metric(servers, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(base_url(servers, "qwen3") + "/metrics").read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllite:request_success_total" and sample.labels["finished_reason"] == reason:
                return sample.value
    return 0.0


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------ replies


@pytest.mark.parametrize("name", list(FAMILIES))
def test_reasoning_calls_and_text_whole_and_streamed(clients, tokenizer, name):
    family = FAMILIES[name]
    client, turn = clients[name], family.first
    kwargs = request(family, tokenizer, turn, [USER])
    response = client.responses.create(**kwargs)
    assert response.object == "response" and response.id.startswith("resp_") and response.status == "completed"
    assert summary(response) == expected(turn)
    usage = response.usage
    assert usage.output_tokens == len(forced(tokenizer, turn.pieces))
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.input_tokens > 0
    assert (usage.output_tokens_details.reasoning_tokens > 0) == bool(turn.reasoning)
    assert usage.output_tokens_details.reasoning_tokens <= usage.output_tokens
    events, final, deltas = collect_events(client.responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.completed" and final.status == "completed"
    assert summary(final) == expected(turn)
    check_stream_adds_up(events, final, deltas)
    assert final.usage.output_tokens == usage.output_tokens


@pytest.mark.parametrize("name", ["qwen3", "llama3_json"])
def test_the_stream_helper_accumulates_the_response(clients, tokenizer, name):
    family = FAMILIES[name]
    with clients[name].responses.stream(**request(family, tokenizer, family.first, [USER])) as stream:
        final = stream.get_final_response()
    assert summary(final) == expected(family.first)


def test_a_text_input_and_instructions_reach_the_template(servers, clients, tokenizer):
    from vllite.plugins.openai_server.chat_template import render_messages
    from vllite.plugins.openai_server.responses_api.input import to_messages
    from vllite.plugins.openai_server.responses_api.protocol import MessageItem

    family, turn = FAMILIES["qwen3"], FAMILIES["qwen3"].second
    kwargs = request(family, tokenizer, turn, "Weather in Paris?", instructions="Be brief.")
    kwargs.pop("tools")
    response = clients["qwen3"].responses.create(**kwargs)
    assert summary(response) == expected(turn) and response.instructions == "Be brief."
    messages = to_messages("Be brief.", [MessageItem(role="user", content="Weather in Paris?")])
    prompt = tokenizer.decode(render_messages(servers.contexts["qwen3"], messages))
    assert "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?" in prompt


def test_max_output_tokens_makes_it_incomplete(clients, tokenizer):
    family = FAMILIES["qwen3"]
    kwargs = request(family, tokenizer, family.second, [USER], max_output_tokens=3)
    response = clients["qwen3"].responses.create(**kwargs)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[-1].status == "incomplete"
    events, final, _ = collect_events(clients["qwen3"].responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_text_format_applies_after_the_reasoning(clients, tokenizer, stream):
    family = FAMILIES["qwen3"]
    turn = Turn(("<think>\n", "Plan it.\n", "</think>", '{"city": "Paris"}'), "Plan it.", '{"city": "Paris"}')
    kwargs = request(family, tokenizer, turn, [USER])
    kwargs.pop("tools")
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    if stream:
        _, response, _ = collect_events(clients["qwen3"].responses.create(stream=True, text=text, **kwargs))
    else:
        response = clients["qwen3"].responses.create(text=text, **kwargs)
    assert summary(response) == expected(turn)
    assert response.text.format.type == "json_schema" and response.text.format.name == "city"


# ------------------------------------------------------------------------------------------------ tool loops


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_two_turn_tool_loop_sending_the_items_back(servers, clients, tokenizer, name):
    from vllite.plugins.openai_server.chat_template import render_messages
    from vllite.plugins.openai_server.responses_api.input import to_messages
    from vllite.plugins.openai_server.responses_api.protocol import ResponsesRequest

    family, client = FAMILIES[name], clients[name]
    first = client.responses.create(**request(family, tokenizer, family.first, [USER]))
    results = [{"type": "function_call_output", "call_id": item.call_id, "output": "22 C"} for item in first.output
               if item.type == "function_call"]  # fmt: skip
    history = [USER, *first.output, *results]
    second = client.responses.create(**request(family, tokenizer, family.second, history))
    assert summary(second) == expected(family.second) and second.status == "completed"
    # the conversation as the template saw it holds the call and its result in the family's form
    items = ResponsesRequest(input=[USER, *(item.model_dump() for item in first.output), *results]).input
    prompt = tokenizer.decode(
        render_messages(
            servers.contexts[name],
            to_messages(None, list(items)),
            tools=TOOLS,
            chat_template_kwargs=family.template_kwargs or None,
        )
    )
    for part in family.rendered:
        assert part in prompt, (part, prompt)


@pytest.mark.parametrize("name", ["qwen3", "mistral", "gpt_oss"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_tool_loop_by_previous_response_id(clients, tokenizer, name, stream):
    family, client = FAMILIES[name], clients[name]
    first = client.responses.create(**request(family, tokenizer, family.first, [USER]))
    calls = [item for item in first.output if item.type == "function_call"]
    results = [{"type": "function_call_output", "call_id": call.call_id, "output": "22 C"} for call in calls]
    kwargs = request(family, tokenizer, family.second, results, previous_response_id=first.id)
    if stream:
        _, second, _ = collect_events(client.responses.create(stream=True, **kwargs))
    else:
        second = client.responses.create(**kwargs)
    assert summary(second) == expected(family.second) and second.previous_response_id == first.id
    # and a third turn continues the second (its conversation holds the first's)
    third = client.responses.create(
        **request(family, tokenizer, family.second, "Thanks!", previous_response_id=second.id)
    )
    assert summary(third) == expected(family.second)


def test_retrieve_delete_and_store_false(clients, tokenizer):
    family, client = FAMILIES["qwen3"], clients["qwen3"]
    stored = client.responses.create(**request(family, tokenizer, family.first, [USER], metadata={"k": "v"}))
    again = client.responses.retrieve(stored.id)
    assert again.model_dump() == stored.model_dump() and again.metadata == {"k": "v"}
    streamed = collect_events(client.responses.create(stream=True, **request(family, tokenizer, family.first, [USER])))
    assert summary(client.responses.retrieve(streamed[1].id)) == expected(family.first)
    unstored = client.responses.create(**request(family, tokenizer, family.first, [USER], store=False))
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(**request(family, tokenizer, family.second, "x", previous_response_id=unstored.id))
    assert missing.value.body["param"] == "previous_response_id"
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)


def test_background_responses_complete_and_cancel(servers, clients, tokenizer):
    family, client = FAMILIES["qwen3"], clients["qwen3"]
    queued = client.responses.create(background=True, **request(family, tokenizer, family.first, [USER]))
    assert queued.status in ("queued", "in_progress") and queued.background
    wait_for(lambda: client.responses.retrieve(queued.id).status == "completed", "the background response never ended")
    assert summary(client.responses.retrieve(queued.id)) == expected(family.first)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.responses.cancel(queued.id)
    aborted = metric(servers, "abort")
    long = request(family, tokenizer, family.first, [USER], max_output_tokens=600, extra_body={"ignore_eos": True})
    long["extra_body"].pop("vllm_xargs")
    running = client.responses.create(background=True, **long)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
    wait_for(lambda: metric(servers, "abort") >= aborted + 1, "the cancelled response was not aborted")


# ------------------------------------------------------------------------------------------------ parity


BAD = [
    # (id, body, status, param, what the message must name)
    ("missing-input", {"model": MODEL}, 400, "input", "input"),
    ("input-type", {"model": MODEL, "input": 5}, 400, "input", "input"),
    ("unknown-field", {"model": MODEL, "input": "x", "foo": 1}, 400, "foo", "foo"),
    ("unknown-item", {"model": MODEL, "input": [{"type": "web_search_call", "id": "w"}]}, 400, "input", "input"),
    ("bad-role", {"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, 400, "input", "role"),
    ("item-field", {"model": MODEL, "input": [{"role": "user", "content": "x", "bar": 1}]}, 400, "input", "bar"),
    ("image-part", {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]
                    }, 400, "input", "text parts"),
    ("builtin-tool", {"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools", "tools"),
    ("schema-missing", {"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, 400,
     "text", "schema"),
    ("unknown-call-id", {"model": MODEL, "input": [
        {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400, "input", "call_x"),
    ("call-output-before-call", {"model": MODEL, "input": [
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]}, 400, "input", "c1"),
    ("max_output_tokens", {"model": MODEL, "input": "x", "max_output_tokens": 5000}, 400, "max_output_tokens",
     "max_output_tokens"),
    ("max_output_tokens-zero", {"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens",
     "max_output_tokens"),
    ("temperature", {"model": MODEL, "input": "x", "temperature": -1}, 400, "temperature", "temperature"),
    ("background-stream", {"model": MODEL, "input": "x", "background": True, "stream": True}, 400, "stream", "stream"),
    ("tool_choice-unknown", {"model": MODEL, "input": "x", "tools": RESPONSE_TOOLS,
                             "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice", "nope"),
    ("unknown-previous", {"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, 404,
     "previous_response_id", "resp_nope"),
    ("unknown-model", {"model": "gpt-9", "input": "x"}, 404, "model", "gpt-9"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "param", "named"), [case[1:] for case in BAD], ids=[c[0] for c in BAD])
def test_bad_requests_get_openai_errors(servers, body, status, param, named):
    got, error = call(servers, "qwen3", "POST", "/v1/responses", body)
    assert got == status, error
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["code"] == status and error["error"]["param"] == param, error
    assert named in error["error"]["message"], error


def test_unknown_ids_are_404_and_the_client_raises_them(servers, clients):
    for method, path in [("GET", "/v1/responses/resp_nope"), ("POST", "/v1/responses/resp_nope/cancel"),
                         ("DELETE", "/v1/responses/resp_nope")]:  # fmt: skip
        status, error = call(servers, "qwen3", method, path)
        assert status == 404 and error["error"]["code"] == 404 and "resp_nope" in error["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        clients["qwen3"].responses.retrieve("resp_nope")


def test_the_api_key_guards_every_responses_route(servers, tokenizer):
    family = FAMILIES["qwen3"]
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    for headers in [{}, {"Authorization": "Bearer wrong"}]:
        for method, path, sent in [("POST", "/v1/responses", body), ("GET", "/v1/responses/resp_x", None)]:
            status, error = call(servers, "auth", method, path, sent, headers)
            assert status == 401 and "API key" in error["error"]["message"]
    with openai.OpenAI(base_url=servers.urls["auth"], api_key=KEY, max_retries=0) as client:
        response = client.responses.create(**request(family, tokenizer, family.second, [USER]))
        assert summary(response) == expected(family.second)
        assert client.responses.retrieve(response.id).id == response.id


def test_metrics_count_the_responses(servers, clients, tokenizer):
    family = FAMILIES["qwen3"]
    before = metric(servers, "stop")
    clients["qwen3"].responses.create(**request(family, tokenizer, family.second, [USER]))
    assert metric(servers, "stop") == before + 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_aborts_its_request(servers, clients, stream):
    before = metric(servers, "abort")
    kwargs = dict(model=MODEL, input="Tell a story.", max_output_tokens=900, extra_body={"ignore_eos": True})
    if stream:
        events = clients["qwen3"].responses.create(stream=True, **kwargs)
        next(iter(events))
        events.close()
    else:
        client = openai.OpenAI(base_url=servers.urls["qwen3"], api_key="x", max_retries=0, timeout=0.5)
        with client, pytest.raises(openai.APITimeoutError):
            client.responses.create(**kwargs)
    wait_for(lambda: metric(servers, "abort") >= before + 1, "the request was not aborted")


def test_continuum_fields_reach_extra_args(clients, tokenizer):
    from vllite.plugins.openai_server.protocol import ChatMessage
    from vllite.plugins.openai_server.responses_api.input import to_chat_request
    from vllite.plugins.openai_server.responses_api.protocol import ResponsesRequest
    from vllite.plugins.openai_server.sampling import build_sampling_params

    body = ResponsesRequest(input="x", job_id=7, is_last_step=False, this_func_call="ls", vllm_xargs={"k": 1})
    chat = to_chat_request(body, [ChatMessage(role="user", content="x")], stream=False)
    params = build_sampling_params(chat, {}, max_tokens=4, logprobs=None)
    assert params.extra_args == {"k": 1, "job_id": "7", "is_last_step": False, "this_func_call": "ls"}
    family = FAMILIES["qwen3"]
    extra = {"job_id": "task-17", "is_last_step": True}
    response = clients["qwen3"].responses.create(**request(family, tokenizer, family.second, [USER], extra_body=extra))
    assert summary(response) == expected(family.second)


def test_the_store_keeps_the_most_recently_used():
    from vllite.plugins.openai_server.responses_api.protocol import ResponseObject
    from vllite.plugins.openai_server.responses_api.store import ResponseNotFoundError, ResponseStore, StoredResponse

    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(StoredResponse(ResponseObject(id=name, model=MODEL, status="completed", output=[])))
    store.get("a")  # now b is the least recently used
    store.put(StoredResponse(ResponseObject(id="c", model=MODEL, status="completed", output=[])))
    assert "a" in store and "c" in store and "b" not in store and len(store) == 2
    with pytest.raises(ResponseNotFoundError, match="'b' not found"):
        store.get("b")
