"""``vllite serve --tool-parser-plugin FILE`` with a tool-parser file written for vLLM (``ToolParser``,
``@ToolParserManager.register_module``), no vLLM installed: the vLLM compatibility layer serves its imports and an
adapter runs it as a vllite tool parser. Checked: whole-text extraction, streaming in any split, end to end through
an in-process server with the ``openai`` client (whole and streamed), and a file importing an unserved ``vllm.*``
name failing with a ``PluginLoadError`` that names the file.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from vllite.plugins.openai_server.parser_plugins import load_parser_plugin

VLLM_PARSER = """
import json
import re

from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager

CALL = re.compile(r"<<call (\\w+) (\\{.*?\\})>>", re.S)
TOKENIZERS = []


@ToolParserManager.register_module(["angle_calls"])
class AngleToolParser(ToolParser):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        TOKENIZERS.append(tokenizer)

    def extract_tool_calls(self, model_output: str, request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        assert request.tools is not None
        calls = [
            ToolCall(function=FunctionCall(name=m[1], arguments=json.dumps(json.loads(m[2]))))
            for m in CALL.finditer(model_output)
        ]
        if not calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        return ExtractedToolCallInformation(
            tools_called=True, tool_calls=calls, content=CALL.sub("", model_output).strip() or None
        )

    def extract_tool_calls_streaming(
        self, previous_text, current_text, delta_text, previous_token_ids, current_token_ids, delta_token_ids, request
    ):
        done = list(CALL.finditer(current_text))
        pieces = []
        for match in done[self.current_tool_id + 1 :]:  # the calls this delta completed
            self.current_tool_id += 1
            name, args = match[1], json.dumps(json.loads(match[2]))
            half = len(args) // 2
            first = DeltaFunctionCall(name=name, arguments=args[:half]).model_dump(exclude_none=True)
            pieces.append(DeltaToolCall(index=self.current_tool_id, id="call_x", type="function", function=first))
            pieces.append(DeltaToolCall(index=self.current_tool_id, function=DeltaFunctionCall(arguments=args[half:])))
        if pieces:
            return DeltaMessage(tool_calls=pieces)
        cut = current_text.find("<")
        if cut < 0:
            return DeltaMessage(content=delta_text)
        if cut > len(previous_text):
            return DeltaMessage(content=current_text[len(previous_text) : cut])
        return None
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TURN = 'Let me check. <<call get_weather {"city": "Paris"}>> <<call get_time {}>>'
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory):
    from vllite.plugin_manager import reset_plugin_manager

    reset_plugin_manager()
    path = tmp_path_factory.mktemp("vllm_parsers") / "angle_vllm_parsers.py"
    path.write_text(VLLM_PARSER)
    load_parser_plugin(str(path))  # what `vllite serve --tool-parser-plugin` calls
    yield path
    reset_plugin_manager()


@pytest.fixture(scope="module")
def parser_class(plugin_file):
    from vllite.plugins.openai_server.context import resolve_tool_parser

    return resolve_tool_parser("angle_calls")


def calls_of(found) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in found.calls]


def test_the_whole_turn_is_extracted_by_the_vllm_parser(parser_class):
    found = parser_class(tools=TOOLS).extract(TURN)
    assert calls_of(found) == CALLS and found.content == "Let me check."
    plain = parser_class(tools=TOOLS).extract("  no call here ")
    assert plain.calls == [] and plain.content == "no call here"
    assert parser_class(tools=TOOLS).parse(TURN) == "multi_tool"


@pytest.mark.parametrize("size", [1, 3, 7, len(TURN)])
def test_streamed_deltas_give_the_same_calls(parser_class, size):
    stream = parser_class(tools=TOOLS).stream()
    sent = [stream.feed(TURN[i : i + size]) for i in range(0, len(TURN), size)]
    end = stream.finish()
    assert "".join(sent) + (end.content or "") == "Let me check."
    assert calls_of(end) == CALLS


def test_an_unserved_vllm_import_names_the_file(tmp_path):
    from vllite.exceptions import PluginLoadError

    path = tmp_path / "unserved_vllm_parsers.py"
    path.write_text("from vllm.entrypoints.openai.serving_chat import OpenAIServingChat\n")
    with pytest.raises(PluginLoadError) as caught:
        load_parser_plugin(str(path))
    assert str(path) in str(caught.value) and "vllm.entrypoints.openai.serving_chat" in str(caught.value)


@pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs the openai client")
def test_the_server_returns_the_vllm_parsers_calls(plugin_file):
    import openai
    from inprocess_servers import InProcessServers
    from parser_families import FAMILIES, forced

    from vllite.assets import default_model_path
    from vllite.engine.tokenizer import get_tokenizer
    from vllite.engine_args import EngineArgs
    from vllite.plugins.openai_server.cli import demo_model_defaults
    from vllite.plugins.openai_server.context import ServerSettings
    from vllite.plugins.openai_server.testing import FORCED_SEQUENCE

    model = str(default_model_path())
    engine_args = EngineArgs(model=model, max_model_len=1024, seed=0, logits_processors=[FORCED_SEQUENCE])
    demo_model_defaults(engine_args)
    settings = ServerSettings(
        served_model_names=("demo",),
        chat_template=FAMILIES["qwen3"].template,
        tool_call_parser="angle_calls",
        enable_auto_tool_choice=True,
        tool_parser_plugins=(str(plugin_file),),
    )
    turn = 'Let me check. <<call get_weather {"city": "Paris"}>>'
    ids = forced(get_tokenizer(model), (turn,))
    servers = InProcessServers(engine_args, {"angle": settings})
    client = openai.OpenAI(base_url=servers.urls["angle"], api_key="unused", max_retries=0)
    try:
        body = dict(
            model="demo",
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS,
            extra_body={"vllm_xargs": {"forced_token_ids": ids}},
        )
        choice = client.chat.completions.create(**body).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        [call] = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

        content, names, arguments, finish = "", [], [], None
        for chunk in client.chat.completions.create(**body, stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                names.append(piece.function.name)
                arguments.append(piece.function.arguments)
            finish = chunk.choices[0].finish_reason or finish
        assert content == "Let me check." and finish == "tool_calls"
        assert names == ["get_weather"] and json.loads("".join(arguments)) == {"city": "Paris"}
    finally:
        client.close()
        servers.close()
    seen = sys.modules[plugin_file.stem].TOKENIZERS
    assert any(callable(getattr(tok, "get_vocab", None)) for tok in seen)  # the server's tokenizer reached it
