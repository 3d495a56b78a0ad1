"""Structured outputs through ``vllite serve`` and the official ``openai`` client: ``response_format`` (json_schema,
json_object), vLLM's ``structured_outputs`` field, forced tool calls (named and ``required``, whole and streamed)
whose arguments validate against the tool's schema, and the 20 bad constraints answered with 400 naming the problem
while the server keeps serving."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from test_structured_output import BAD_CASES  # noqa: E402

from vllite.plugins.openai_server.testing import RemoteServer  # noqa: E402

MODEL = "demo"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 12},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["title", "rating", "genres"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
MESSAGES = [{"role": "user", "content": "Tell me about a film."}]


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", MODEL, "--max-model-len", "512", "--seed", "0"]
    args += ["--structured-outputs-config", '{"disable_any_whitespace": true}']
    with RemoteServer(args) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


def test_response_format_json_schema(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=1.0,
        n=4,
        max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA, "strict": True}},
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_object(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0.0, max_tokens=300, response_format={"type": "json_object"}
    )
    choice = response.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"regex": r"[A-Z][a-z]{2,7} [0-9]{4}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,7} [0-9]{4}", t)),
        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        (
            {"grammar": 'root ::= "x=" [0-9]{1,3} (";" "x=" [0-9]{1,3}){0,2}'},
            lambda t: re.fullmatch(r"x=[0-9]{1,3}(;x=[0-9]{1,3}){0,2}", t),
        ),
        ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ],
    ids=["regex", "choice", "grammar", "json"],
)
def test_structured_outputs_field_on_completions(client, constraint, check):
    response = client.completions.create(
        model=MODEL,
        prompt="Answer:",
        temperature=1.0,
        n=3,
        max_tokens=300,
        extra_body={"structured_outputs": constraint},
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_call_arguments_validate(client, stream):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        max_tokens=200,
    )
    if not stream:
        (call,) = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    else:
        name = arguments = ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_calls_validate(client, stream):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather and time?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: a random model would otherwise list calls until max_tokens
        temperature=1.0,
        max_tokens=300,
    )
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    else:
        pieces: dict[int, list[str]] = {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = pieces.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
        calls = [(name, arguments) for name, arguments in pieces.values()]
    assert len(calls) == 1
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_constraints_are_400_naming_the_problem(server, client):
    for _, kwargs, config, match in BAD_CASES:
        fields = {k: v for k, v in kwargs.items()}
        if config.backend != "auto":
            fields["backend"] = config.backend
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": fields}
        status, answer = post(server, "/v1/completions", body)
        assert status == 400, answer
        assert re.search(match, answer["error"]["message"]), answer
        assert answer["error"]["param"] == "structured_outputs", answer
    status, answer = post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {}}},
    )
    assert status == 400 and answer["error"]["param"] == "response_format"
    status, answer = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"},
        },
    )
    assert status == 400 and "give only one" in answer["error"]["message"]
    # The server keeps serving.
    ok = client.completions.create(
        model=MODEL, prompt="x", max_tokens=8, extra_body={"structured_outputs": {"choice": ["a", "b"]}}
    )
    assert ok.choices[0].text in ("a", "b")


UNSUPPORTED = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNSUPPORTED}}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": UNSUPPORTED}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": UNSUPPORTED}}],
          "tool_choice": "required"}, "tools"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ],
    ids=["response_format", "named-tool", "required-tools", "structured_outputs"],
)  # fmt: skip
def test_a_constraint_the_backends_refuse_names_its_field(server, fields, param):
    status, answer = post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **fields})
    assert status == 400 and answer["error"]["param"] == param, answer
