"""Tool-call parsers: mini-swe-agent bash blocks, OpenAI-style JSON, Hermes blocks, Llama pythonic calls, and the
``auto`` chain — the tool name (``parse``) and the calls themselves (``extract``). Streaming: test_tool_call_streams."""

from __future__ import annotations

import json

import pytest

from vllite.plugins.tool_parsers.parsers import (
    MAX_TEXT_CHARS,
    MULTI_TOOL,
    PARSERS,
    AutoParser,
    BashParser,
    ExtractedToolCalls,
    HermesParser,
    LlamaPythonicParser,
    OpenAIJSONParser,
    ToolCall,
)

BASH_ONE = "THOUGHT: look around.\n\n```bash\nls -la /testbed && cd src\n```\n"
BASH_TWO = "```bash\nls\n```\nthen\n```bash\ngrep x\n```\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (BASH_ONE, "ls"),
        ("```bash\n  pytest tests/ -x\n```", "pytest"),
        (BASH_TWO, None),  # the released rule: exactly one block
        ("```python\nprint(1)\n```", None),
        ("```bash\n\n```", None),
        ("no code", None),
    ],
)
def test_bash(text, expected):
    assert BashParser().parse(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"type": "function_call", "name": "fetch_url", "arguments": "{}"}', "fetch_url"),
        ('{"name": "search", "arguments": {"q": "x"}}', "search"),
        ('{"name": "search", "parameters": {"q": "x"}}', "search"),  # Llama-3.1 JSON
        (
            '{"tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}',
            "get_weather",
        ),
        ('[{"name": "a", "arguments": {}}, {"name": "a", "arguments": {}}]', "a"),
        ('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', MULTI_TOOL),
        ('Sure, calling it now: {"name": "lookup", "arguments": {"id": 3}} done', "lookup"),
        ('{"name": "just a name"}', None),  # a dict with a name but no call shape
        ("not json {", None),
    ],
)
def test_openai_json(text, expected):
    assert OpenAIJSONParser().parse(text) == expected


def test_hermes():
    p = HermesParser()
    one = '<tool_call>\n{"name": "web_search", "arguments": {"q": "a"}}\n</tool_call>'
    assert p.parse("I will search.\n" + one) == "web_search"
    assert p.parse(one + one) == "web_search"
    two = one + '<tool_call>{"name": "fetch", "arguments": {}}</tool_call>'
    assert p.parse(two) == MULTI_TOOL
    assert p.parse("<tool_call>{broken</tool_call>") is None
    assert p.parse("no tags") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('get_weather(city="Paris", unit="c")', "get_weather"),
        ("<|python_tag|>search(query='vllm')", "search"),
        ('[fetch(url="a"), fetch(url="b")]', "fetch"),
        ('[fetch(url="a"), parse(x=1)]', MULTI_TOOL),
        ("math.sqrt(x=4)", "math.sqrt"),
        ("noop()", "noop"),
        ("print(x)", None),  # positional arguments: not the keyword-call format
        ("The answer is 42.", None),
        ("x = f(a=1)", None),
    ],
)
def test_llama_pythonic(text, expected):
    assert LlamaPythonicParser().parse(text) == expected


def test_auto_tries_each_format():
    p = AutoParser()
    assert p.parse(BASH_ONE) == "ls"
    assert p.parse('<tool_call>{"name": "h", "arguments": {}}</tool_call>') == "h"
    assert p.parse('{"name": "j", "arguments": {}}') == "j"
    assert p.parse('lookup(id="3")') == "lookup"
    assert p.parse("Final answer: done.") is None
    assert p.parse("") is None


# ---------------------------------------------------------------- extraction (what the OpenAI server returns)


def calls(*pairs: tuple[str, str]) -> list[ToolCall]:
    return [ToolCall(name, arguments) for name, arguments in pairs]


HERMES_CALL = '<tool_call>\n{"name": "web_search", "arguments": {"q": "a"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("parser", "text", "content", "expected"),
    [
        ("hermes", "I will search.\n" + HERMES_CALL + "\n", "I will search.", calls(("web_search", '{"q": "a"}'))),
        (
            "hermes",
            'A <tool_call>{"name": "f"}</tool_call> B <tool_call>{"name": "g", "arguments": "{}"}</tool_call> C',
            'A <tool_call>{"name": "f"}</tool_call> B  C',  # not a call (no arguments): stays in the content
            calls(("g", "{}")),
        ),
        ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}', '<tool_call>{"name": "f", "arguments": {}}', []),
        ("hermes", '<tool_call>{"name": "é", "arguments": {"s": "ü"}}</tool_call>', None, calls(("é", '{"s": "ü"}'))),
        ("openai", '{"name": "search", "parameters": {"q": "x"}}', None, calls(("search", '{"q": "x"}'))),
        (
            "openai",
            '{"tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{\\"c\\": 1}"}}]}',
            None,
            calls(("w", '{"c": 1}')),
        ),
        ("openai", '{"type": "function_call", "name": "f"}', None, calls(("f", "{}"))),
        (
            "openai",
            'Sure: {"name": "a", "arguments": {"id": 3}} and {"name": "b", "arguments": {}}.',
            "Sure:  and .",
            calls(("a", '{"id": 3}'), ("b", "{}")),
        ),
        ("openai", '{"a": {"name": "x", "arguments": {}}}', '{"a": {"name": "x", "arguments": {}}}', []),
        ("openai", '{"name": "f", "arguments": "not json"}', '{"name": "f", "arguments": "not json"}', []),
        ("openai", '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": [1]}', []),
        ("openai", '[{"name": "f", "arguments": {}}, 3]', '[{"name": "f", "arguments": {}}, 3]', []),
        ("openai", "  plain text  ", "plain text", []),
        ("llama", 'get_weather(city="Paris", days=3)', None, calls(("get_weather", '{"city": "Paris", "days": 3}'))),
        (
            "llama",
            "Checking.<|python_tag|>[f(a=[1, (2, 3)], b=None), m.g(c={'k': True})]",
            "Checking.",
            calls(("f", '{"a": [1, [2, 3]], "b": null}'), ("m.g", '{"c": {"k": true}}')),
        ),
        ("llama", "f(a=x)", "f(a=x)", []),  # not a literal
        ("llama", "f(a=1, a=2)", "f(a=1, a=2)", []),
        ("llama", "f(a=1e999)", "f(a=1e999)", []),  # infinity is not JSON
        ("llama", "f(a=1) # done", "f(a=1) # done", []),  # the call must be the whole text
        ("llama", "[]", "[]", []),
        (
            "bash",
            BASH_ONE,
            "THOUGHT: look around.",
            calls(("bash", json.dumps({"command": "ls -la /testbed && cd src"}))),
        ),
        ("bash", BASH_TWO, BASH_TWO.strip(), []),
        ("bash", "```bash\n\n```", "```bash\n\n```", []),
        ("auto", '<tool_call>{"name": "h", "arguments": {}}</tool_call>', None, calls(("h", "{}"))),
        ("auto", 'lookup(id="3")', None, calls(("lookup", '{"id": "3"}'))),
        ("auto", "Final answer: done.", "Final answer: done.", []),
        ("auto", "", None, []),
    ],
)
def test_extract(parser, text, content, expected):
    result = PARSERS[parser]().extract(text)
    assert result == ExtractedToolCalls(content, expected)
    for call in result.calls:
        assert isinstance(json.loads(call.arguments), dict)


def test_parse_names_what_extract_finds():
    assert BashParser().extract(BASH_ONE).calls[0].name == "bash"  # while parse names the command
    assert AutoParser().parse(BASH_ONE) == "ls"
    assert LlamaPythonicParser().parse("f(a=x)") is None  # malformed calls name nothing
    assert AutoParser().parse("x" * (MAX_TEXT_CHARS + 1)) is None


def test_every_registered_parser_extracts_and_streams():
    from vllite import plugin_manager

    for name in ("auto", "bash", "openai", "hermes", "llama"):
        parser = plugin_manager.resolve_component("tool_parsers", name)()
        assert parser.extract("Hi there") == ExtractedToolCalls("Hi there", [])
        stream = parser.stream()
        assert stream.feed("Hi there") == "Hi there" and stream.finish() == ExtractedToolCalls(None, [])
