"""``/v1/messages`` and ``/v1/messages/count_tokens`` driven by the official ``anthropic`` client: per model family
(its chat template and parsers, ``parser_families``; a logits processor forces the family's exact output), the tool
calls, thinking and text come back as Anthropic's content blocks, whole and streamed; a two-turn tool loop; stop
sequences, ``max_tokens``, forced tools; token counting; bad input as Anthropic's error object (400, 404, 401); and a
client that goes away aborts its request (counted in ``/metrics``), as on the OpenAI routes.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

import pytest

anthropic = pytest.importorskip("anthropic")

from parser_families import FAMILIES, TOOLS, Family, Turn, forced, start_family_servers  # noqa: E402

from vllite.assets import default_model_path  # noqa: E402

MODEL = "demo"
KEY = "secret-key"
USER = {"role": "user", "content": "Weather in Paris?"}
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
#: Families whose reasoning parser needs the template's ``thinking`` argument: Anthropic's ``thinking`` sets it.
THINKING = {"type": "enabled", "budget_tokens": 128}


@pytest.fixture(scope="module")
def servers():
    harness = start_family_servers(MODEL, auth=("qwen3_coder", KEY), metrics=True)
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def clients(servers):
    made = {
        name: anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0)
        for name, url in servers.urls.items()
    }
    yield made
    for client in made.values():
        client.close()


@pytest.fixture(scope="module")
def tokenizer():
    from vllite.engine.tokenizer import get_tokenizer

    return get_tokenizer(default_model_path())


def request(family: Family, tokenizer, turn: Turn, messages: list, **extra) -> dict:
    kwargs = dict(model=MODEL, max_tokens=256, messages=messages, tools=ANTHROPIC_TOOLS, **extra)
    if family.template_kwargs:
        kwargs["thinking"] = THINKING
    kwargs["extra_body"] = {"vllm_xargs": {"forced_token_ids": forced(tokenizer, turn.pieces)}}
    return kwargs


def blocks_of(message) -> tuple[str | None, str | None, tuple]:
    """``(thinking, text, calls)`` of a message, checking the blocks come in Anthropic's order."""
    kinds = [block.type for block in message.content]
    assert kinds == sorted(kinds, key=["thinking", "text", "tool_use"].index), kinds
    thinking = "".join(block.thinking for block in message.content if block.type == "thinking") or None
    text = "".join(block.text for block in message.content if block.type == "text") or None
    calls = tuple((block.name, block.input) for block in message.content if block.type == "tool_use")
    return thinking, text, calls


def expected(turn: Turn) -> tuple:
    return turn.reasoning, turn.content, turn.calls


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tool_calls_thinking_and_text_whole_and_streamed(clients, tokenizer, name):
    family = FAMILIES[name]
    client, turn = clients[name], family.first
    kwargs = request(family, tokenizer, turn, [USER])
    message = client.messages.create(**kwargs)
    assert isinstance(message, anthropic.types.Message)
    assert message.id.startswith("msg_") and message.model == MODEL and message.role == "assistant"
    assert blocks_of(message) == expected(turn)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert all(block.id for block in message.content if block.type == "tool_use")
    assert message.usage.output_tokens == len(kwargs["extra_body"]["vllm_xargs"]["forced_token_ids"])
    with client.messages.stream(**kwargs) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == (turn.content or "")
    assert blocks_of(final) == expected(turn)
    assert (final.stop_reason, final.usage.output_tokens) == ("tool_use", message.usage.output_tokens)
    prompt = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert prompt == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_the_stream_is_anthropics_event_sequence(clients, tokenizer):
    family = FAMILIES["qwen3"]
    events = list(clients["qwen3"].messages.create(stream=True, **request(family, tokenizer, family.first, [USER])))
    assert [events[0].type, events[-2].type, events[-1].type] == ["message_start", "message_delta", "message_stop"]
    start = events[0].message
    assert (start.content, start.stop_reason, start.usage.output_tokens) == ([], None, 0)
    assert start.id.startswith("msg_") and start.usage.input_tokens > 0
    started = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert started == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    delta_kind = {"thinking": "thinking_delta", "text": "text_delta", "tool_use": "input_json_delta"}
    open_block = None
    for item in events[1:-2]:  # each block: its start, deltas of its kind, its stop; then the next block
        if item.type == "content_block_start":
            assert open_block is None
            open_block = (item.index, item.content_block.type)
        elif item.type == "content_block_delta":
            assert open_block is not None and (item.index, item.delta.type) == (
                open_block[0],
                delta_kind[open_block[1]],
            )
        else:
            assert item.type == "content_block_stop" and open_block is not None and item.index == open_block[0]
            open_block = None
    assert open_block is None
    assert events[-2].delta.stop_reason == "tool_use" and events[-2].usage.output_tokens > 0


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1", "mistral", "llama3_json", "gpt_oss"])
def test_a_two_turn_tool_loop(servers, clients, tokenizer, name):
    from vllite.plugins.openai_server.anthropic.messages import chat_request
    from vllite.plugins.openai_server.anthropic.protocol import CountTokensRequest
    from vllite.plugins.openai_server.chat_template import render_messages

    family = FAMILIES[name]
    client = clients[name]
    first = client.messages.create(**request(family, tokenizer, family.first, [USER]))
    results = [
        {"type": "tool_result", "tool_use_id": block.id, "content": [{"type": "text", "text": "22 C"}]}
        for block in first.content
        if block.type == "tool_use"
    ]
    history = [USER, {"role": "assistant", "content": first.content}, {"role": "user", "content": results}]
    second = client.messages.create(**request(family, tokenizer, family.second, history))
    assert blocks_of(second) == expected(family.second)
    assert second.stop_reason == "end_turn"
    raw = [USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}]
    body = CountTokensRequest(model=MODEL, messages=[*raw, history[2]], tools=ANTHROPIC_TOOLS)
    chat = chat_request(body)
    prompt = render_messages(servers.contexts[name], chat.messages, tools=[t.model_dump() for t in chat.tools])
    text = tokenizer.decode(prompt)
    for part in family.rendered:
        assert part in text, (part, text)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_and_max_tokens(clients, tokenizer, stream):
    client = clients["qwen3_coder"]
    ids = forced(tokenizer, ("Hello there. STOP and more text",))

    def create(**kwargs):
        kwargs = dict(model=MODEL, messages=[USER], extra_body={"vllm_xargs": {"forced_token_ids": ids}}, **kwargs)
        if not stream:
            return client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as events:
            return events.get_final_message()

    stopped = create(max_tokens=64, stop_sequences=["STOP"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "STOP")
    assert blocks_of(stopped) == (None, "Hello there. ", ())
    cut = create(max_tokens=3)
    assert (cut.stop_reason, cut.stop_sequence, cut.usage.output_tokens) == ("max_tokens", None, 3)
    whole = create(max_tokens=64, system=[{"type": "text", "text": "Be brief."}], metadata={"user_id": "u-1"})
    assert (whole.stop_reason, blocks_of(whole)[1]) == ("end_turn", "Hello there. STOP and more text")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("choice", "output"),
    [
        ({"type": "tool", "name": "get_weather"}, '{"city": "Paris"}'),
        ({"type": "any"}, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
    ],
)
def test_a_forced_tool_choice_returns_a_tool_use(clients, tokenizer, choice, output, stream):
    client = clients["qwen3_coder"]
    kwargs = request(FAMILIES["qwen3_coder"], tokenizer, Turn((output,), None, None), [USER], tool_choice=choice)
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert blocks_of(message) == (None, None, (("get_weather", {"city": "Paris"}),))
    assert message.stop_reason == "tool_use"


def test_thinking_disabled_makes_the_reply_text(servers, clients, tokenizer):
    family = FAMILIES["qwen3"]
    kwargs = request(family, tokenizer, Turn(("Hello there.",), None, "Hello there."), [USER])
    message = clients["qwen3"].messages.create(thinking={"type": "disabled"}, **kwargs)
    assert blocks_of(message) == (None, "Hello there.", ())
    assert message.stop_reason == "end_turn"


def test_count_tokens_is_the_rendered_prompt(servers, clients, tokenizer):
    from vllite.plugins.openai_server.chat_template import render_messages
    from vllite.plugins.openai_server.protocol import ChatMessage

    client = clients["qwen3"]
    system = "You are terse."
    counted = client.messages.count_tokens(model=MODEL, messages=[USER], system=system, tools=ANTHROPIC_TOOLS)
    messages = [ChatMessage(role="system", content=system), ChatMessage(**USER)]
    assert counted.input_tokens == len(render_messages(servers.contexts["qwen3"], messages, tools=TOOLS))
    plain = client.messages.count_tokens(model=MODEL, messages=[USER])
    assert plain.input_tokens < counted.input_tokens
    family = FAMILIES["qwen3"]
    usage = client.messages.create(**request(family, tokenizer, family.second, [USER], system=system)).usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens


# ---------------------------------------------------------------- conversion (no engine)


def test_the_conversation_becomes_the_chat_templates_messages():
    from vllite.plugins.openai_server.anthropic.messages import chat_request
    from vllite.plugins.openai_server.anthropic.protocol import MessagesRequest

    body = MessagesRequest.model_validate(
        {
            "model": MODEL,
            "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            "tools": ANTHROPIC_TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "thinking": {"type": "enabled", "budget_tokens": 64},
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Look it up.", "signature": ""},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}},
                        {"type": "tool_result", "tool_use_id": "t1", "content": "22 C", "is_error": False},
                    ],
                },
                {"role": "assistant", "content": "It is"},
            ],
        }
    )
    chat = chat_request(body)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user", "assistant"]
    assert chat.messages[0].content == "Be brief.\nBe kind."
    call = chat.messages[2].tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "t1",
        "get_weather",
        {"city": "Paris"},
    )
    assert chat.messages[2].reasoning_content == "Look it up." and chat.messages[2].content is None
    assert (chat.messages[3].tool_call_id, chat.messages[3].content) == ("t1", "22 C")
    assert chat.continue_final_message and not chat.add_generation_prompt  # the last assistant turn is continued
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"enable_thinking": True, "thinking": True}
    assert chat.thinking_token_budget == 64 and chat.max_tokens == 8 and chat.request_id.startswith("msg_")


# ---------------------------------------------------------------- errors, auth, disconnects


def post(servers, name: str, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    """``(status, JSON body)`` of a POST to a server's ``/v1`` route ``path``."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **(headers or {})}
    sent = urllib.request.Request(servers.urls[name] + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(sent, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def anthropic_error(response: tuple[int, dict], status: int, kind: str) -> str:
    assert response[0] == status, response
    body = response[1]
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


GOOD = {"model": MODEL, "max_tokens": 8, "messages": [USER]}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"model": MODEL, "messages": [USER]}, "max_tokens: Field required"),
        ({**GOOD, "messages": {"role": "user", "content": "hi"}}, "messages: Input should be a valid"),
        ({**GOOD, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
        ({**GOOD, "messages": []}, "messages"),
        ({**GOOD, "max_tokens": 0}, "max_tokens"),
        ({**GOOD, "temprature": 0.5}, "temprature: Extra inputs are not permitted"),
        ({**GOOD, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
        (
            {
                **GOOD,
                "messages": [USER, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}],
            },
            "tool_use_id 'nope' answers no tool_use",
        ),
        (
            {**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "'image' blocks are not supported",
        ),
        (
            {
                **GOOD,
                "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
            },
            "belongs in an assistant turn",
        ),
        ({**GOOD, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}}, "needs the tool's name"),
        ({**GOOD, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "f"}}, "'f'"),
        ({**GOOD, "max_tokens": 5000}, "max_tokens=5000 is too large"),
        (b'{"model": "demo", ', "The request body is not valid JSON"),
    ],
)
def test_bad_input_is_400_in_anthropics_shape(servers, body, named):
    message = anthropic_error(post(servers, "qwen3_coder", "/messages", body), 400, "invalid_request_error")
    assert named in message, message


def test_the_client_raises_anthropics_errors(clients):
    client = clients["qwen3_coder"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-no-such", max_tokens=8, messages=[USER])
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert "claude-no-such" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-no-such", messages=[USER])
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "tool", "content": "x"}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages="not a list")


def test_the_api_key_is_read_from_x_api_key_or_bearer(servers):
    url = servers.urls["auth"].removesuffix("/v1")
    with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            wrong.messages.create(model=MODEL, max_tokens=4, messages=[USER])
        assert caught.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.count_tokens(model=MODEL, messages=[USER])
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0) as right:
        assert right.messages.count_tokens(model=MODEL, messages=[USER]).input_tokens > 0
        assert right.messages.create(model=MODEL, max_tokens=2, messages=[USER]).usage.output_tokens == 2
    conversation = {"model": MODEL, "messages": [USER]}
    anthropic_error(post(servers, "auth", "/messages/count_tokens", conversation), 401, "authentication_error")
    status, body = post(servers, "auth", "/messages/count_tokens", conversation, {"authorization": f"Bearer {KEY}"})
    assert status == 200 and body["input_tokens"] > 0
    # The OpenAI routes keep asking for the bearer token, in OpenAI's shape.
    status, body = post(servers, "auth", "/chat/completions", GOOD, {"x-api-key": KEY})
    assert status == 401 and body["error"]["code"] == 401


def abort_count(servers) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    url = servers.urls["qwen3_coder"].removesuffix("/v1") + "/metrics"
    for family in text_string_to_metric_families(urllib.request.urlopen(url).read().decode()):
        for sample in family.samples:
            if sample.name == "vllite:request_success_total" and sample.labels["finished_reason"] == "abort":
                return sample.value
    return 0.0


def wait_for_aborts(servers, count: float) -> None:
    deadline = time.monotonic() + 20
    while abort_count(servers) < count:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.1)
    assert abort_count(servers) == count
    assert servers.call(servers.engine.call_utility("get_request_counts")) == [0, 0]


def test_a_client_that_goes_away_aborts_its_request(servers, clients):
    long = dict(model=MODEL, max_tokens=900, messages=[USER], extra_body={"ignore_eos": True})
    before = abort_count(servers)
    with clients["qwen3_coder"].messages.stream(**long) as stream:
        next(iter(stream))  # message_start: the request runs; leaving the block closes the connection
    wait_for_aborts(servers, before + 1)
    host, port = servers.urls["qwen3_coder"].removeprefix("http://").removesuffix("/v1").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({**GOOD, "max_tokens": 900, "ignore_eos": True})
    connection.request("POST", "/v1/messages", body=body, headers={"content-type": "application/json"})
    time.sleep(0.5)  # the request runs; the client leaves before its answer
    connection.close()
    wait_for_aborts(servers, before + 2)
