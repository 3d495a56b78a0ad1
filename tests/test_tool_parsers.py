"""Tool-call parsers: mini-swe-agent bash blocks, OpenAI-style JSON, Hermes blocks, Llama pythonic calls, and the
``auto`` chain."""

from __future__ import annotations

import pytest

from vllite.policies.tool_parsers import (
    MULTI_TOOL,
    AutoParser,
    BashParser,
    HermesParser,
    LlamaPythonicParser,
    OpenAIJSONParser,
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
