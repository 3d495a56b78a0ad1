"""Streaming tool-call extraction: every parser's ``stream()`` agrees with its ``extract()`` however the turn is
split into deltas, sends content as early as promised, and the scanners behind it never give up on text that
may still be a call (hypothesis over texts built from call, near-call and prose fragments).
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllite.plugins.tool_parsers.parsers import PARSERS, ExtractedToolCalls, ToolCall
from vllite.plugins.tool_parsers.scanners import DEAD, MAX_JSON_DEPTH, JSONPrefix, PythonicHead

FRAGMENTS = [
    # prose and whitespace
    "Hello",
    "Sure, calling it now:",
    "The answer is 42.",
    "x = f(a=1)",
    "Note(see below): ",
    " ",
    "\n",
    "  \n",
    "\u00a0",
    "é",
    # hermes
    '<tool_call>\n{"name": "web_search", "arguments": {"q": "a"}}\n</tool_call>',
    '<tool_call>{"name": "fetch", "arguments": "{}"}</tool_call>',
    "<tool_call>{broken</tool_call>",
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "_call>",
    # openai JSON
    '{"name": "lookup", "arguments": {"id": 3}}',
    '[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"x": [1, 2.5e3]}}]',
    '{"tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{\\"c\\": \\"{\\"}"}}]}',
    '{"a": {"name": "x", "arguments": {}}}',
    '{"name": "f", "arguments": "bad"}',
    '{"a": "}"}',
    "[1, NaN, -Infinity]",
    "{",
    "}",
    "[",
    "]",
    '"',
    ",",
    ":",
    # llama pythonic
    'get_weather(city="Paris", unit="c")',
    "<|python_tag|>",
    "<|python",
    "[fetch(url='a'), fetch(url=\"b)\")]",
    "search(q='''x)'''",
    "f(a=1) # c",
    "print(x)",
    "noop()",
    "(",
    ")",
    "'",
    "#",
    # bash
    "```bash\nls -la /testbed\n```",
    "```bash\n",
    "\n```",
    "```python\nprint(1)\n```",
    "```",
]

texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=8).map("".join)


def run_stream(parser_name: str, text: str, cuts: list[int]) -> tuple[list[str], ExtractedToolCalls]:
    stream = PARSERS[parser_name]().stream()
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    sent = [stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    return sent, stream.finish()


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
@settings(max_examples=300, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 200), max_size=12), data=st.data())
def test_stream_agrees_with_extract(parser_name, text, cuts, data):
    sent, finished = run_stream(parser_name, text, cuts)
    expected = PARSERS[parser_name]().extract(text)
    assert "".join(sent) + (finished.content or "") == (expected.content or "")
    assert finished.calls == expected.calls
    # one character at a time as well (the split a token stream makes most often)
    sent, finished = run_stream(parser_name, text, list(range(len(text))))
    assert "".join(sent) + (finished.content or "") == (expected.content or "")
    assert finished.calls == expected.calls


@pytest.mark.parametrize(
    ("parser_name", "deltas", "sent"),
    [
        ("hermes", ["I will ", "search.\n<tool"], ["I will", " search."]),  # a partial tag is held back
        ("hermes", ["Hi <tool", "box> there"], ["Hi", " <toolbox> there"]),  # ... and sent when it is not one
        ("hermes", ['<tool_call>{"name": "f", "arguments": {}}</tool_call>', " Done"], ["", "Done"]),
        ("openai", ['  {"name": "f", ', '"arguments": {}}'], ["", ""]),
        ("openai", ["Use {x} or ", '{"a": 1}', " here"], ["Use {x} or", ' {"a": 1}', " here"]),
        ("llama", ["<|python_tag|>", "f(a=1)"], ["", ""]),
        ("llama", ["Let me check.<|py", "thon_tag|>f(a=1)"], ["Let me check.", ""]),
        ("llama", ["get_weather(", 'city="Paris")'], ["", ""]),
        ("llama", ["The ", "answer"], ["", "The answer"]),
        ("bash", ["THOUGHT: ok\n``", "`bash\nls\n```"], ["THOUGHT: ok", ""]),
        ("auto", ["Hello ", "world", " <tool_call>"], ["", "Hello world", ""]),
    ],
)
def test_stream_sends_content_early(parser_name, deltas, sent):
    stream = PARSERS[parser_name]().stream()
    assert [stream.feed(delta) for delta in deltas] == sent


def test_finish_returns_withheld_text_and_calls():
    stream = PARSERS["hermes"]().stream()
    assert stream.feed('Calling.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>') == "Calling."
    assert stream.feed(" <tool") == ""
    result = stream.finish()
    assert result == ExtractedToolCalls(" <tool", [ToolCall("f", '{"a": 1}')])
    assert stream.finish() is result
    with pytest.raises(RuntimeError):
        stream.feed("more")


# ---------------------------------------------------------------- scanners

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3),
    max_leaves=8,
)


def scan(scanner: JSONPrefix | PythonicHead, text: str, cuts: list[int]) -> list[int | None]:
    """The scanner's answers after each cut, then at the end."""
    return [scanner.advance(text[:cut]) for cut in sorted(c for c in cuts if c < len(text))] + [scanner.advance(text)]


@settings(max_examples=300, deadline=None)
@given(
    value=json_values.filter(lambda v: isinstance(v, (list, dict))),
    indent=st.sampled_from([None, 0, 2]),
    separators=st.sampled_from([None, (",", ":"), (" , ", " : ")]),
    tail=st.text(max_size=3),
    cuts=st.lists(st.integers(0, 100), max_size=8),
)
def test_json_prefix_follows_every_value_json_reads(value, indent, separators, tail, cuts):
    text = json.dumps(value, indent=indent, separators=separators)
    answers = scan(JSONPrefix(0), text + tail, cuts)
    assert all(answer is None or answer == len(text) for answer in answers)
    assert answers[-1] == len(text)


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet='{}[]",: 0.1-eEtruflsnNaIiy\\\n', max_size=20).map(lambda t: "[" + t))
def test_json_prefix_agrees_with_json(text):
    answer = JSONPrefix(0).advance(text)
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        assert answer is None or answer == DEAD or answer > 0  # json may still reject what it completes
    else:
        assert answer == end


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ('f(a=")", b=1)', 13),
        ("m.g (x='''a)''')", 16),
        ("[f(a=1), g()] tail", 13),
        ("f(a=[1, 2}", DEAD),
        ("f(a='", None),
        ("x = f(a=1)", DEAD),
        ("math . sqrt", None),
        ("f(a=1 # )\n)", 11),
        ("(f(a=1))", DEAD),
    ],
)
def test_pythonic_head(text, answer):
    assert PythonicHead(0).advance(text) == answer


def test_json_prefix_holds_back_values_nested_too_deep():
    text = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    assert JSONPrefix(0).advance(text) is None  # never DEAD, never complete: the stream holds it to the end
    assert JSONPrefix(0).advance(text[1:]) == len(text) - 2
