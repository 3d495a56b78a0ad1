"""End to end: each model family's tool and reasoning parsers behind the server, driven by the official ``openai``
client. One demo-model engine serves one app per family (its chat template and parsers, ``parser_families``); a
logits processor forces the family's exact output. Checked: tool calls, reasoning and text, whole and streamed (the
stream adds up to the whole); a two-turn tool loop through the family's template; ``enable_thinking: false``,
``include_reasoning: false``, structured outputs after the reasoning, and a thinking budget ended by the parser's
marker. Start-up errors (unknown names, a parser file that fails) need no engine.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")

from parser_families import FAMILIES, TOOLS, Family, Turn, forced, start_family_servers  # noqa: E402

from vllite.assets import default_model_path  # noqa: E402

MODEL = "demo"
USER = {"role": "user", "content": "Weather in Paris?"}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def servers():
    harness = start_family_servers(MODEL)
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


def request(family: Family, tokenizer, turn: Turn, messages: list, **extra) -> dict:
    body = {"vllm_xargs": {"forced_token_ids": forced(tokenizer, turn.pieces)}, **extra}
    if family.template_kwargs:
        body["chat_template_kwargs"] = family.template_kwargs
    return dict(model=MODEL, messages=messages, tools=TOOLS, extra_body=body)


def reasoning_of(message) -> str | None:
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")  # vLLM's two names carry the same text
    return extra.get("reasoning_content")


def calls_of(tool_calls) -> tuple:
    return tuple((call.function.name, json.loads(call.function.arguments)) for call in tool_calls or [])


def collect_stream(chunks) -> tuple[str, str, tuple, str | None]:
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning_content") or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    found = tuple((calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls))
    return reasoning, content, found, finish


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tool_calls_reasoning_and_text_whole_and_streamed(clients, tokenizer, name):
    family = FAMILIES[name]
    client, turn = clients[name], family.first
    kwargs = request(family, tokenizer, turn, [USER])
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert (reasoning_of(choice.message), choice.message.content) == (turn.reasoning, turn.content)
    assert calls_of(choice.message.tool_calls) == turn.calls
    assert choice.finish_reason == "tool_calls"
    if name == "mistral":
        assert all(len(call.id) == 9 and call.id.isalnum() for call in choice.message.tool_calls)
    streamed = collect_stream(client.chat.completions.create(stream=True, **kwargs))
    assert streamed == (turn.reasoning or "", turn.content or "", turn.calls, "tool_calls")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_two_turn_tool_loop(servers, clients, tokenizer, name):
    from vllite.plugins.openai_server.chat_template import render_messages
    from vllite.plugins.openai_server.protocol import ChatMessage

    family = FAMILIES[name]
    client = clients[name]
    first = client.chat.completions.create(**request(family, tokenizer, family.first, [USER])).choices[0].message
    history = [USER, first.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": call.id, "content": "22 C"} for call in first.tool_calls]
    choice = client.chat.completions.create(**request(family, tokenizer, family.second, history)).choices[0]
    assert (reasoning_of(choice.message), choice.message.content) == (family.second.reasoning, family.second.content)
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    ctx = servers.contexts[name]
    messages = [ChatMessage(**message) for message in history]
    kwargs = family.template_kwargs or None
    prompt = tokenizer.decode(render_messages(ctx, messages, tools=TOOLS, chat_template_kwargs=kwargs))
    for part in family.rendered:
        assert part in prompt, (part, prompt)


def test_enable_thinking_false_makes_the_reply_content(clients, tokenizer, servers):
    from vllite.plugins.openai_server.chat_template import render_messages
    from vllite.plugins.openai_server.protocol import ChatMessage

    family, turn = FAMILIES["qwen3"], Turn(("Hello there.",), None, "Hello there.")
    kwargs = request(family, tokenizer, turn, [USER])
    kwargs["extra_body"]["chat_template_kwargs"] = {"enable_thinking": False}
    message = clients["qwen3"].chat.completions.create(**kwargs).choices[0].message
    assert (reasoning_of(message), message.content) == (None, "Hello there.")
    prompt = render_messages(
        servers.contexts["qwen3"], [ChatMessage(**USER)], chat_template_kwargs={"enable_thinking": False}
    )
    assert tokenizer.decode(prompt).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_drops_it_from_the_reply(clients, tokenizer, stream):
    family = FAMILIES["qwen3"]
    kwargs = request(family, tokenizer, family.second, [USER], include_reasoning=False)
    if stream:
        reasoning, content, _, _ = collect_stream(clients["qwen3"].chat.completions.create(stream=True, **kwargs))
        assert (reasoning, content) == ("", family.second.content)
    else:
        message = clients["qwen3"].chat.completions.create(**kwargs).choices[0].message
        assert (reasoning_of(message), message.content) == (None, family.second.content)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_structured_outputs_apply_after_the_reasoning(clients, tokenizer, name):
    family = FAMILIES[name]
    opener = ("<think>\n",) if name == "qwen3" else ()
    turn = Turn((*opener, "Plan it.\n", "</think>", '{"city": "Paris"}'), "Plan it.", '{"city": "Paris"}')
    kwargs = request(family, tokenizer, turn, [USER])
    kwargs.pop("tools")
    schema = {"name": "city", "schema": CITY}
    choice = (
        clients[name]
        .chat.completions.create(response_format={"type": "json_schema", "json_schema": schema}, **kwargs)
        .choices[0]
    )
    assert (reasoning_of(choice.message), choice.message.content) == (turn.reasoning, turn.content)
    assert choice.finish_reason == "stop"


def test_the_thinking_budget_ends_the_section_with_the_parsers_marker(clients, tokenizer):
    # DeepSeek-R1's template opens <think> in the prompt; once 4 tokens were thought, the parser's </think> is forced.
    choice = (
        clients["deepseek_r1"]
        .chat.completions.create(
            model=MODEL,
            messages=[USER],
            max_tokens=24,
            temperature=0,
            extra_body={"thinking_token_budget": 4, "min_tokens": 16, "return_token_ids": True},
        )
        .choices[0]
    )
    end = tokenizer.encode("</think>", add_special_tokens=False)
    token_ids = choice.model_extra["token_ids"]
    # The budget counts thinking tokens from the marker: the prompt's newline after <think>, then 3 generated.
    assert token_ids[3 : 3 + len(end)] == end
    assert reasoning_of(choice.message) == (tokenizer.decode(token_ids[:3]).strip() or None)
    assert "</think>" not in (choice.message.content or "")


def test_a_final_answer_comes_out_of_the_harmony_framing(clients, tokenizer):
    family = FAMILIES["gpt_oss"]
    kwargs = request(family, tokenizer, family.second, [USER])
    kwargs["tool_choice"] = "none"
    message = clients["gpt_oss"].chat.completions.create(**kwargs).choices[0].message
    assert (reasoning_of(message), message.content) == ("Report it.", "22 C in Paris.")


# ---------------------------------------------------------------- start-up errors (no engine)


def settings_for(args: list[str]):
    import argparse

    from vllite.plugins.openai_server.cli import add_serve_arguments, server_settings

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return server_settings(parser.parse_args(args), "m")


@pytest.fixture
def fresh_plugins():
    from vllite.plugin_manager import reset_plugin_manager

    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.mark.parametrize(
    ("flag", "known"),
    [("--reasoning-parser", ["deepseek_r1", "granite", "openai_gptoss", "qwen3"]), ("--tool-call-parser", ["mistral"])],
)
def test_an_unknown_parser_name_lists_the_known_ones(flag, known):
    from vllite.exceptions import UnknownComponentError

    with pytest.raises(UnknownComponentError) as caught:
        settings_for([flag, "no_such_parser"])
    assert "no_such_parser" in str(caught.value) and all(name in str(caught.value) for name in known)


def test_the_serve_command_stops_with_one_line_naming_the_known_parsers():
    run = subprocess.run(
        [sys.executable, "-m", "vllite.cli", "serve", "--reasoning-parser", "deepseek"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "vllite: error: Unknown reasoning parser 'deepseek'. Available: deepseek_r1, deepseek_v3" in run.stderr


PLUGIN = """
from vllite import hookimpl
from vllite.plugins.tool_parsers.parsers import HermesParser


class ShoutingParser(HermesParser):
    pass


@hookimpl
def vllite_register_tool_parsers(register):
    register("shouting", ShoutingParser)
"""


def test_a_parser_plugin_file_registers_its_parsers(tmp_path, fresh_plugins):
    path = tmp_path / "shouting_parsers.py"
    path.write_text(PLUGIN)
    settings = settings_for(["--tool-parser-plugin", str(path), "--tool-call-parser", "shouting"])
    assert settings.tool_call_parser == "shouting" and settings.tool_parser_plugins == (str(path),)
    from vllite.plugins.openai_server.context import resolve_tool_parser

    assert resolve_tool_parser("shouting").__name__ == "ShoutingParser"


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("import no_such_module_anywhere\n", "ModuleNotFoundError"),
        ("x = 1\n", "implements no vllite hook"),
        (
            "from vllite import hookimpl\n@hookimpl\ndef vllite_register_tool_parser(register):\n    pass\n",
            "unknown hook",
        ),
    ],
)
def test_a_parser_plugin_file_that_fails_names_the_file(tmp_path, fresh_plugins, source, named):
    from vllite.exceptions import PluginLoadError

    path = tmp_path / f"broken_parsers_{abs(hash(source)) % 10_000}.py"
    path.write_text(source)
    with pytest.raises(PluginLoadError) as caught:
        settings_for(["--tool-parser-plugin", str(path)])
    assert str(path) in str(caught.value) and named in str(caught.value)


def test_a_missing_parser_plugin_file_is_named(tmp_path):
    from vllite.exceptions import PluginLoadError

    with pytest.raises(PluginLoadError, match="there is no Python file"):
        settings_for(["--tool-parser-plugin", str(tmp_path / "nowhere.py")])


def test_continuum_names_tools_with_the_servers_parser(tmp_path, fresh_plugins):
    from vllite.engine_args import EngineArgs
    from vllite.plugins.openai_server.parser_plugins import load_parser_plugin, share_tool_parser

    continuum = EngineArgs(scheduler_cls="continuum")
    share_tool_parser(continuum, "mistral")
    assert continuum.policy_args == {"tool_parser": "mistral"}
    chosen = EngineArgs(scheduler_cls="continuum", policy_args={"tool_parser": "bash"})
    share_tool_parser(chosen, "mistral")
    assert chosen.policy_args == {"tool_parser": "bash"}
    fcfs = EngineArgs()
    share_tool_parser(fcfs, "mistral")
    assert fcfs.policy_args == {}
    path = tmp_path / "continuum_parsers.py"
    path.write_text(PLUGIN)
    load_parser_plugin(str(path))
    from_file = EngineArgs(scheduler_cls="continuum")
    share_tool_parser(from_file, "shouting")  # the engine-core process imports it by class path
    assert from_file.policy_args == {"tool_parser": "continuum_parsers:ShoutingParser"}


def test_the_builtin_parsers_are_registered_under_vllms_names():
    from vllite.plugin_manager import get_registry

    reasoning = ["deepseek_r1", "deepseek_v3", "granite", "mistral", "openai_gptoss", "qwen3", "think"]
    assert sorted(get_registry("reasoning_parsers")) == reasoning
    tools = (
        "hermes",
        "qwen3_xml",
        "qwen3_coder",
        "mistral",
        "llama3_json",
        "deepseek_v3",
        "pythonic",
        "granite",
        "openai",
    )
    assert set(tools) <= set(get_registry("tool_parsers"))
