"""Reasoning parsers, under vLLM's ``--reasoning-parser`` names: table-driven tests on each family's real output
(as its chat template documents it), the streaming promise (seeded random chunkings, one character at a time, and
hypothesis over each family's fragments: the streamed reasoning and content equal the whole-text split), the request
switches (``enable_thinking`` / ``thinking``, a prompt that opens the section), the registry and the hook, and the
token ids the server hands the engine (thinking budget, structured outputs after the reasoning)."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllite import hookimpl
from vllite.exceptions import InternalStateError, UnknownComponentError
from vllite.plugins.reasoning.registry import reasoning_parser_names, resolve_reasoning_parser

HARMONY_FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"
HARMONY_CALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}"

# (parser, constructor kwargs, text, reasoning, content)
CASES = [
    ("think", {}, "<think>\nPlan it.\n</think>\n\nAnswer.", "Plan it.", "Answer."),
    ("think", {}, "Answer without thinking.", None, "Answer without thinking."),
    ("think", {}, "<think>\nStill thinking", "Still thinking", None),
    ("think", {}, "  <think>a</think>b", "a", "b"),
    ("think", {}, "Say <think> later</think> x", None, "Say <think> later</think> x"),
    ("think", {}, "<think>\n\n</think>\n\nHi", None, "Hi"),
    ("think", {"prompt_open": True}, "Plan.\n</think>\nAnswer", "Plan.", "Answer"),
    (
        "deepseek_r1",
        {},
        "Okay, the user asks 2+2.\n</think>\n\nThe answer is 4.",
        "Okay, the user asks 2+2.",
        "The answer is 4.",
    ),
    ("deepseek_r1", {}, "<think>\nOkay.\n</think>\n\n4", "Okay.", "4"),
    ("deepseek_r1", {}, "Okay, still going", "Okay, still going", None),
    ("deepseek_r1", {"thinking": False}, "4", None, "4"),
    ("qwen3", {}, "<think>\nLet me think.\n</think>\n\nHello!", "Let me think.", "Hello!"),
    ("qwen3", {}, "Hello!", None, "Hello!"),
    ("qwen3", {"thinking": False}, "Hello!", None, "Hello!"),
    ("qwen3", {"prompt_open": True}, "Plan.\n</think>\n\nHello!", "Plan.", "Hello!"),
    (
        "qwen3",
        {},
        '<think>\nNeed it.\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "Need it.",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    ),
    ("deepseek_v3", {}, "Okay.</think>Answer", None, "Okay.</think>Answer"),
    ("deepseek_v3", {"thinking": True}, "Okay.</think>Answer", "Okay.", "Answer"),
    ("granite", {"thinking": True}, "Here is my thought process:\nA.\nHere is my response:\nB.", "A.", "B."),
    ("granite", {"thinking": True}, "Here's my thought process: A Here's my response: B", "A", "B"),
    ("granite", {"thinking": True}, "Here is my thought process:\nA", "A", None),
    ("granite", {"thinking": True}, "Plain answer.", None, "Plain answer."),
    ("granite", {"thinking": True}, "Here is my", None, "Here is my"),
    ("mistral", {}, "[THINK]Check the units.[/THINK]Answer.", "Check the units.", "Answer."),
    ("openai_gptoss", {}, "<|channel|>analysis<|message|>Think." + HARMONY_FINAL + "Hi", "Think.", "Hi"),
    ("openai_gptoss", {}, "<|channel|>analysis<|message|>Think.<|end|>" + HARMONY_CALL, "Think.", HARMONY_CALL),
    ("openai_gptoss", {}, "<|channel|>final<|message|>Hi", None, "Hi"),
    ("openai_gptoss", {}, "<|start|>assistant<|channel|>analysis<|message|>x<|end|>", "x", None),
]


def parser(name: str, kwargs: dict):
    return resolve_reasoning_parser(name)(**kwargs)


def streamed(name: str, kwargs: dict, text: str, cuts: list[int]) -> tuple[str | None, str | None]:
    stream = parser(name, kwargs).stream()
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    reasoning = content = ""
    for a, b in itertools.pairwise(bounds):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return (reasoning + r) or None, (content + c) or None


@pytest.mark.parametrize(("name", "kwargs", "text", "reasoning", "content"), CASES)
def test_whole_text(name, kwargs, text, reasoning, content):
    assert parser(name, kwargs).extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "kwargs", "text", "reasoning", "content"), CASES)
def test_streamed_in_random_chunkings_equals_the_whole(name, kwargs, text, reasoning, content):
    rng = random.Random(f"{name}:{text}")
    for _ in range(40):
        cuts = [rng.randrange(len(text) + 1) for _ in range(rng.randrange(1, 12))]
        assert streamed(name, kwargs, text, cuts) == (reasoning, content), cuts
    assert streamed(name, kwargs, text, list(range(len(text)))) == (reasoning, content)


@pytest.mark.parametrize(
    ("name", "deltas", "sent"),
    [
        ("qwen3", ["<think>\nPlan", " more\n</thi", "nk>\n\nHi"], [("Plan", ""), (" more", ""), ("", "Hi")]),
        ("qwen3", ["Hel", "lo"], [("", "Hel"), ("", "lo")]),
        ("qwen3", ["<thi", "s is not it"], [("", ""), ("", "<this is not it")]),
        ("deepseek_r1", ["Okay", ", so.\n</", "think>\n\n4"], [("Okay", ""), (", so.", ""), ("", "4")]),
        (
            "granite",
            ["Here is my thought process:", " A.", " Here is my resp", "onse: B"],
            [("", ""), ("A.", ""), ("", ""), ("", "B")],
        ),
        (
            "openai_gptoss",
            ["<|channel|>analysis<|message|>Hm", "<|end|><|start|>assistant<|channel|>fi", "nal<|message|>Hi"],
            [("Hm", ""), ("", ""), ("", "Hi")],
        ),
    ],
)
def test_each_side_is_sent_as_soon_as_it_is_certain(name, deltas, sent):
    stream = parser(name, {"thinking": True}).stream()
    assert [stream.feed(delta) for delta in deltas] == sent


def test_finish_returns_the_rest_once_and_feed_after_it_fails():
    stream = parser("qwen3", {}).stream()
    assert stream.feed("<think>\nA </thi") == ("A", "")
    assert stream.finish() == (" </thi", "")
    assert stream.finish() == (" </thi", "")
    with pytest.raises(InternalStateError):
        stream.feed("more")


FRAGMENTS = {
    "think": ["<think>", "</think>", "<th", "</", "ink>"],
    "deepseek_r1": ["<think>", "</think>", "</th", "\n"],
    "qwen3": ["<think>", "</think>", "<tool_call>", "<thi"],
    "deepseek_v3": ["<think>", "</think>"],
    "granite": [
        "Here is my thought process:",
        "Here's my thought process:",
        "Here is my response:",
        "Here's my response:",
        "Here is my",
        "Here's",
        ":",
    ],
    "mistral": ["[THINK]", "[/THINK]", "[THI", "[/"],
    "openai_gptoss": [
        "<|channel|>analysis<|message|>",
        "<|start|>assistant",
        "<|channel|>final<|message|>",
        "<|end|>",
        HARMONY_FINAL,
        "<|channel|>",
        "<|",
        "commentary to=functions.f <|message|>{}",
    ],
}
PROSE = ["Hello", " ", "\n", "é", "x y", ""]


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_streams_agree_with_the_whole_on_mixed_fragments(name, data):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[name] + PROSE), max_size=8)))
    kwargs = {"thinking": data.draw(st.booleans()), "prompt_open": data.draw(st.booleans())}
    cuts = data.draw(st.lists(st.integers(0, max(len(text), 1)), max_size=10))
    assert streamed(name, kwargs, text, cuts) == parser(name, kwargs).extract_reasoning(text)


def test_every_family_is_registered_under_vllms_name():
    assert reasoning_parser_names() == [
        "deepseek_r1",
        "deepseek_v3",
        "granite",
        "mistral",
        "openai_gptoss",
        "qwen3",
        "think",
    ]


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(UnknownComponentError, match=r"Unknown reasoning parser 'r1'\. Available: deepseek_r1, "):
        resolve_reasoning_parser("r1")


@pytest.mark.parametrize(
    ("name", "kwargs", "wanted"),
    [
        ("qwen3", None, True),
        ("qwen3", {"enable_thinking": False}, False),
        ("deepseek_v3", None, False),
        ("deepseek_v3", {"thinking": True}, True),
        ("granite", {"thinking": True}, True),
        ("deepseek_r1", {"enable_thinking": False, "thinking": True}, False),
    ],
)
def test_the_request_says_whether_it_wants_reasoning(name, kwargs, wanted):
    assert resolve_reasoning_parser(name).thinking_requested(kwargs) is wanted


@pytest.mark.parametrize(
    ("name", "tail", "open_"),
    [
        ("deepseek_r1", "<｜User｜>Hi<｜Assistant｜><think>\n", True),  # noqa: RUF001
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("qwen3", "<|im_start|>assistant\n", False),
        ("granite", "<|start_of_role|>assistant<|end_of_role|>", False),
    ],
)
def test_a_prompt_that_opens_the_section(name, tail, open_):
    assert resolve_reasoning_parser(name).prompt_opens_section(tail) is open_


def test_a_third_party_parser_registers_through_the_hook():
    from vllite.plugin_manager import PluginManager
    from vllite.plugins.reasoning.markers import MarkerReasoningParser

    class SeedThink(MarkerReasoningParser):
        start_markers = ("<seed:think>",)
        end_markers = ("</seed:think>",)

    class Plugin:
        @staticmethod
        @hookimpl
        def vllite_register_reasoning_parsers(register):
            register("seed_oss", SeedThink)

    manager = PluginManager(load_entry_points=False, extra_plugins=(Plugin,))
    found = manager.resolve("reasoning_parsers", "seed_oss")
    assert found().extract_reasoning("<seed:think>a</seed:think>b") == ("a", "b")
    assert (found.start_marker, found.end_marker) == ("<seed:think>", "</seed:think>")


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


def mode_for(name: str, template_kwargs=None, prompt: str = ""):
    from vllite.plugins.openai_server.protocol import ChatCompletionRequest
    from vllite.plugins.openai_server.reasoning import ReasoningMode

    ctx = SimpleNamespace(reasoning_parser_class=resolve_reasoning_parser(name), tokenizer=_Tokenizer())
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], chat_template_kwargs=template_kwargs)
    return ctx, ReasoningMode.for_request(ctx, request, _Tokenizer().encode(prompt))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_thinking_budget_ends_the_section_with_the_parsers_markers():
    ctx, mode = mode_for("granite", {"thinking": True})
    params = SimpleNamespace(extra_args={"job_id": "7"})
    mode.apply(ctx, params, budget=64, constrained=False)
    assert params.extra_args == {
        "job_id": "7",
        "thinking_token_budget": 64,
        "think_start_token_ids": ids("Here is my thought process:"),
        "think_end_token_ids": ids("Here is my response:"),
    }
    own = SimpleNamespace(extra_args={"thinking_token_budget": 8, "think_end_token_ids": [5]})
    mode.apply(ctx, own, budget=None, constrained=False)
    assert own.extra_args["think_end_token_ids"] == [5] and own.extra_args["think_start_token_ids"]


@pytest.mark.parametrize(
    ("name", "template_kwargs", "prompt", "gated"),
    [
        ("qwen3", None, "<|im_start|>assistant\n", True),
        ("qwen3", {"enable_thinking": False}, "<think>\n\n</think>\n\n", False),
        ("deepseek_v3", None, "<｜Assistant｜>", False),  # noqa: RUF001
        ("deepseek_r1", {"enable_thinking": False}, "<｜Assistant｜><think>\n", True),  # noqa: RUF001
    ],
)
def test_a_constrained_reply_is_constrained_after_the_reasoning(name, template_kwargs, prompt, gated):
    ctx, mode = mode_for(name, template_kwargs, prompt)
    params = SimpleNamespace(extra_args=None)
    mode.apply(ctx, params, budget=None, constrained=True)
    expected = {"reasoning_end_token_ids": ids("</think>")} if gated else None
    assert params.extra_args == expected
