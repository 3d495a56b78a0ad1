"""The tool-call parsers of the model families, under vLLM's names: table-driven tests on each family's real output
format (as its chat template documents it), malformed calls that must stay text, and the streaming promise: for
seeded random chunkings and one character at a time, the streamed content and calls equal the whole-text
extraction (hypothesis then mixes each family's fragments with prose)."""

# ruff: noqa: RUF001  (DeepSeek's markers use fullwidth bars)

from __future__ import annotations

import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllite.plugin_manager import resolve_component
from vllite.plugins.tool_parsers.extraction import ExtractedToolCalls

PARIS = ("get_weather", {"city": "Paris"})
OSLO = ("get_weather", {"city": "Oslo"})
TIME = ("get_time", {"tz": "UTC"})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                    "where": {"type": "object"},
                    "ratio": {"type": "number"},
                },
            },
        },
    }
]

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}\n```<｜tool▁call▁end｜>"
HARMONY_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>'
)


def ds(city: str) -> str:
    return DS_CALL.replace("{}", json.dumps({"city": city}))


def xml(*params: tuple[str, str], name: str = "get_weather") -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (parser, text, content, calls)
CASES = [
    # hermes: Hermes 2 Pro, Qwen2.5, Qwen3
    (
        "hermes",
        'I\'ll check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "I'll check.",
        [PARIS],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        None,
        [PARIS, OSLO],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
        [],
    ),
    ("hermes", 'Calling <tool_call>\n{"name": "get_weather"', 'Calling <tool_call>\n{"name": "get_weather"', []),
    # qwen3_coder / qwen3_xml: Qwen3-Coder
    (
        "qwen3_coder",
        "I'll check.\n" + xml(("city", "Paris"), ("days", "3")),
        "I'll check.",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    ("qwen3_xml", xml(("city", "Paris")) + "\n" + xml(("city", "Oslo")), None, [PARIS, OSLO]),
    (
        "qwen3_coder",
        xml(("metric", "true"), ("hours", "[1, 2]"), ("where", '{"lat": 1.5}'), ("ratio", "0.5")),
        None,
        [("get_weather", {"metric": True, "hours": [1, 2], "where": {"lat": 1.5}, "ratio": 0.5})],
    ),
    (
        "qwen3_coder",
        xml(("code", "def f():\n    return 1"), name="run"),
        None,
        [("run", {"code": "def f():\n    return 1"})],
    ),  # a tool the request lacks: values stay text
    ("qwen3_coder", xml(("city", "null")), None, [("get_weather", {"city": "null"})]),  # a string stays a string
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        [],
    ),
    ("qwen3_coder", xml(("city", "Paris"), ("city", "Oslo")), xml(("city", "Paris"), ("city", "Oslo")), []),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
        [],
    ),
    # mistral: Mistral 7B v0.3 (JSON list), v11 (name{args}), v13 (name[ARGS]{args})
    (
        "mistral",
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "UTC"}}]',
        "Sure.",
        [PARIS, TIME],
    ),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}', None, [PARIS]),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
        None,
        [PARIS, TIME],
    ),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', None, [PARIS]),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
        [],
    ),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]not json", "[TOOL_CALLS]get_weather[ARGS]not json", []),
    ("mistral", "Plain [TOOL answer", "Plain [TOOL answer", []),
    # llama3_json: Llama 3.1 / 3.3 / 4 JSON calls
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        None,
        [PARIS, OSLO],
    ),
    (
        "llama3_json",
        'Checking.<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "Checking.",
        [PARIS],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        [],
    ),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("llama3_json", '{"name": "f", "parameters": {}} is the call', '{"name": "f", "parameters": {}} is the call', []),
    ("llama3_json", '{"name": "f", "parameters": {}};', '{"name": "f", "parameters": {}};', []),
    ("llama4_json", 'The JSON is {"a": 1}', 'The JSON is {"a": 1}', []),
    # deepseek_v3: DeepSeek-V3 / R1 (and V3.1's form)
    ("deepseek_v3", "Let me check." + DS_BEGIN + ds("Paris") + DS_END, "Let me check.", [PARIS]),
    ("deepseek_v3", DS_BEGIN + ds("Paris") + "\n" + ds("Oslo") + DS_END, None, [PARIS, OSLO]),
    (
        "deepseek_v31",
        DS_BEGIN + '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>' + DS_END,
        None,
        [PARIS],
    ),
    ("deepseek_v3", DS_BEGIN + ds("Paris"), None, [PARIS]),  # stopped before the section's end
    (
        "deepseek_v3",
        DS_BEGIN + ds("Paris").replace("\n```<", "<") + DS_END,
        DS_BEGIN + ds("Paris").replace("\n```<", "<") + DS_END,
        [],
    ),
    ("deepseek_v3", DS_BEGIN + ds("Paris")[:-12], DS_BEGIN + ds("Paris")[:-12], []),
    # pythonic: Llama 3.2 / 4 pythonic calls (vllite's llama)
    ("pythonic", '[get_weather(city="Paris"), get_time(tz="UTC")]', None, [PARIS, TIME]),
    ("pythonic", "[get_weather(city=Paris)]", "[get_weather(city=Paris)]", []),
    # granite: Granite 3.x
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
    (
        "granite",
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
        None,
        [PARIS, TIME],
    ),
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}',
        [],
    ),
    ("granite", "[1, 2] are numbers", "[1, 2] are numbers", []),
    # openai: gpt-oss harmony (and JSON calls)
    ("openai", "<|channel|>analysis<|message|>Need the weather.<|end|>" + HARMONY_CALL, "Need the weather.", [PARIS]),
    ("openai", HARMONY_CALL, None, [PARIS]),
    ("openai", "<|channel|>commentary<|message|>Checking.<|end|>" + HARMONY_CALL, "Checking.", [PARIS]),
    ("openai", "<|channel|>final<|message|>It is 22 C.", "It is 22 C.", []),
    (
        "openai",
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": <|call|>',
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": <|call|>',
        [],
    ),
    (
        "openai",
        "<|channel|>commentary to=browser.search<|message|>{}<|call|>",
        "<|channel|>commentary to=browser.search<|message|>{}<|call|>",
        [],
    ),
    ("openai", '{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
]


def parser_for(name: str):
    cls = resolve_component("tool_parsers", name)
    return cls(tools=TOOLS) if getattr(cls, "accepts_tools", False) else cls()


def as_tuples(result: ExtractedToolCalls) -> list:
    return [(call.name, json.loads(call.arguments)) for call in result.calls]


def streamed(name: str, text: str, cuts: list[int]) -> tuple[str | None, list]:
    stream = parser_for(name).stream()
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    sent = "".join(stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds))
    result = stream.finish()
    return (sent + (result.content or "")) or None, as_tuples(result)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_text(name, text, content, calls):
    result = parser_for(name).extract(text)
    assert (result.content, as_tuples(result)) == (content, calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streamed_in_random_chunkings_equals_the_whole(name, text, content, calls):
    rng = random.Random(f"{name}:{text}")
    for _ in range(40):
        cuts = [rng.randrange(len(text) + 1) for _ in range(rng.randrange(1, 12))]
        assert streamed(name, text, cuts) == (content, calls), cuts
    assert streamed(name, text, list(range(len(text)))) == (content, calls)


@pytest.mark.parametrize(
    ("name", "deltas", "sent"),
    [
        ("qwen3_coder", ["I'll check.\n<tool", "_call>\n<function=f>\n</function>\n</tool_call>"], ["I'll check.", ""]),
        ("mistral", ["Sure, ", "checking.[TOOL_", "CALLS]f{}"], ["Sure,", " checking.", ""]),
        ("llama3_json", ['{"name": ', '"f", "parameters": {}}'], ["", ""]),
        ("llama3_json", ["Hello ", "there<|python_tag|>"], ["Hello", " there"]),
        ("deepseek_v3", ["Let me check.<｜tool▁", "calls▁begin｜>"], ["Let me check.", ""]),
        ("granite", ["Here you go", ": done"], ["Here you go", ": done"]),
        ("openai", ["<|chan", "nel|>final<|message|>It is", " 22 C.<|e"], ["", "It is", " 22 C."]),
        ("openai", ["<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"], [""]),
    ],
)
def test_content_is_sent_as_early_as_it_is_certain(name, deltas, sent):
    stream = parser_for(name).stream()
    assert [stream.feed(delta) for delta in deltas] == sent


def test_mistral_call_ids_are_nine_alphanumerics():
    make_id = resolve_component("tool_parsers", "mistral").tool_call_id
    ids = {make_id() for _ in range(50)}
    assert len(ids) > 40 and all(len(i) == 9 and i.isalnum() for i in ids)


def test_markers_that_are_special_tokens_ask_to_keep_them():
    keep = {
        name
        for name in ("mistral", "granite", "deepseek_v3", "openai", "hermes", "llama3_json")
        if resolve_component("tool_parsers", name).skip_special_tokens is False
    }
    assert keep == {"mistral", "granite", "deepseek_v3", "openai"}


FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", '\n{"name": "f", "arguments": {"a": 1}}\n', "<tool", "{"],
    "qwen3_coder": [
        "<tool_call>",
        "</tool_call>",
        "<function=get_weather>",
        "</function>",
        "<parameter=days>",
        "</parameter>",
        "\n3\n",
        "\nParis\n",
        "<para",
    ],
    "mistral": [
        "[TOOL_CALLS]",
        "[ARGS]",
        "get_weather",
        '{"city": "Paris"}',
        '[{"name": "f", "arguments": {}}]',
        "[TOOL_",
        "]",
    ],
    "llama3_json": ["<|python_tag|>", '{"name": "f", "parameters": {"a": 1}}', "; ", ";", "{", "}"],
    "deepseek_v3": [DS_BEGIN, DS_END, ds("Paris"), "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "```json\n", "<｜"],
    "granite": ["<|tool_call|>", '[{"name": "f", "arguments": {}}]', "[", "]", "<|tool"],
    "openai": [
        "<|channel|>",
        "<|start|>assistant",
        "analysis",
        "final",
        "commentary to=functions.f ",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        '{"a": 1}',
        "<|",
        HARMONY_CALL,
        '{"name": "f", "arguments": {}}',
    ],
    "pythonic": ["[f(a=1)]", "g(b='x')", "(", ")", "[", "]"],
}
PROSE = ["Hello", " ", "\n", "Sure: ", "é", "{x}"]


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_streams_agree_with_the_whole_on_mixed_fragments(name, data):
    pieces = data.draw(st.lists(st.sampled_from(FRAGMENTS[name] + PROSE), max_size=8))
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, max(len(text), 1)), max_size=10))
    whole = parser_for(name).extract(text)
    assert streamed(name, text, cuts) == (whole.content, as_tuples(whole))
