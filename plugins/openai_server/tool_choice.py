"""``tools`` and ``tool_choice`` resolved once per request into a :class:`ToolMode`: what the chat template gets,
how a finished reply becomes content and ``tool_calls``, and how a streamed reply becomes deltas."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.protocol import ChatCompletionRequest, NamedToolChoice, random_id
from vllite.plugins.openai_server.responses import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)

#: The parser for ``tool_choice="required"``: the reply is constrained to vLLM's forced format, a JSON list of calls.
REQUIRED_FALLBACK_PARSER = "openai"


class ToolMode:
    """No tool calling (``tool_choice="none"`` or no tools): the text is the content."""

    #: ``False`` when the reply must be detokenized with its special tokens (the parser's markers are special).
    skip_special_tokens: bool | None = None

    def __init__(self, template_tools: list[dict[str, Any]] | None = None) -> None:
        self.template_tools = template_tools

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished reply's content and calls."""
        return text, []

    def finish_reason(self, sample_finish: str | None, calls: list[Any]) -> str | None:
        """The choice's ``finish_reason``."""
        return sample_finish

    def stream(self) -> Any:
        """A per-choice streaming extractor: ``feed(text) -> [DeltaMessage]``, ``finish() -> ([DeltaMessage],
        [DeltaToolCall])``."""
        return _PlainStream()


class _PlainStream:
    def feed(self, text: str) -> list[DeltaMessage]:
        return [DeltaMessage(content=text)] if text else []

    def finish(self) -> tuple[list[DeltaMessage], list[DeltaToolCall]]:
        return [], []


class ParsedToolMode(ToolMode):
    """``auto`` / ``required``: a tool parser finds the calls in the text."""

    def __init__(
        self,
        template_tools: list[dict[str, Any]],
        parser_class: type,
        *,
        server_parser: bool = True,
        tokenizer: Any = None,
    ) -> None:
        super().__init__(template_tools)
        self.parser_class = parser_class
        self.tokenizer = tokenizer
        if server_parser:
            self.skip_special_tokens = getattr(parser_class, "skip_special_tokens", None)
        make_id = getattr(parser_class, "tool_call_id", None)
        self.call_id: Callable[[], str] = make_id if callable(make_id) else _random_call_id

    def parser(self) -> Any:
        """A parser for one reply; one that ``accepts_tools`` gets the request's tools (for argument types), one that
        ``accepts_tokenizer`` the server's tokenizer (a vLLM parser's adapter)."""
        kwargs: dict[str, Any] = {}
        if getattr(self.parser_class, "accepts_tools", False):
            kwargs["tools"] = self.template_tools
        if getattr(self.parser_class, "accepts_tokenizer", False):
            kwargs["tokenizer"] = self.tokenizer
        return self.parser_class(**kwargs)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        found = self.parser().extract(text)
        calls = [_tool_call(call.name, call.arguments, self.call_id()) for call in found.calls]
        return (found.content or None) if calls else text, calls

    def finish_reason(self, sample_finish: str | None, calls: list[Any]) -> str | None:
        return "tool_calls" if calls and sample_finish == "stop" else sample_finish

    def stream(self) -> Any:
        return _ParsedStream(self.parser().stream(), self.call_id)


class _ParsedStream:
    def __init__(self, extractor: Any, call_id: Callable[[], str]) -> None:
        self.extractor = extractor
        self.call_id = call_id

    def feed(self, text: str) -> list[DeltaMessage]:
        content = self.extractor.feed(text) if text else ""
        return [DeltaMessage(content=content)] if content else []

    def finish(self) -> tuple[list[DeltaMessage], list[DeltaToolCall]]:
        found = self.extractor.finish()
        deltas = [DeltaMessage(content=found.content)] if found.content else []
        calls = [
            DeltaToolCall(
                index=i,
                id=self.call_id(),
                type="function",
                function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
            )
            for i, call in enumerate(found.calls)
        ]
        if calls:
            deltas.append(DeltaMessage(tool_calls=calls))
        return deltas, calls


class RequiredToolMode(ParsedToolMode):
    """``required``: the reply is constrained to vLLM's JSON list of calls. Its calls are the list's complete items,
    so a reply cut short (``max_tokens``) keeps the calls it finished, with no content and ``finish_reason="length"``
    (vLLM's); streamed, each call goes out as one delta once its item is complete."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if not text.lstrip().startswith("["):  # not the constrained list (no constraint applied): the text as is
            return super().extract(text)
        calls, _, _ = required_calls(text)
        return None, [_tool_call(call.name, call.arguments, self.call_id()) for call in calls]

    def stream(self) -> Any:
        return _RequiredStream(self.call_id)


def required_calls(text: str, start: int = 0) -> tuple[list[Any], int, bool]:
    """The calls of the complete items of the JSON list of calls in ``text``, read from ``start`` (0, or a position
    an earlier call returned); also where reading stopped and whether the list has ended (or cannot go on)."""
    from vllite.plugins.tool_parsers.extraction import json_calls

    decoder = json.JSONDecoder()
    calls: list[Any] = []
    pos = start
    if pos == 0:
        pos = len(text) - len(text.lstrip())
        if not text.startswith("[", pos):
            return calls, 0, bool(text.strip())
        pos += 1
    while True:
        item = pos
        while item < len(text) and text[item] in " \t\r\n,":
            item += 1
        if text.startswith("]", item):
            return calls, item + 1, True
        try:
            value, end = decoder.raw_decode(text, item)
        except (ValueError, RecursionError):
            return calls, pos, False  # the item is not complete yet
        found = json_calls(value)
        if not found:
            return calls, pos, True  # not a call: the list cannot go on as calls
        calls.extend(found)
        pos = end


class _RequiredStream:
    def __init__(self, call_id: Callable[[], str]) -> None:
        self.call_id = call_id
        self.text = ""
        self.pos = 0
        self.count = 0
        self.ended = False
        self.plain = False  # the reply is not a list (no constraint applied): its text is the content

    def feed(self, text: str) -> list[DeltaMessage]:
        self.text += text
        if not self.plain and self.text.strip() and not self.text.lstrip().startswith("["):
            self.plain, text = True, self.text
        if self.plain:
            return [DeltaMessage(content=text)] if text else []
        if self.ended or "}" not in text:  # an item (an object) can only be completed by a closing brace
            return []
        calls, self.pos, self.ended = required_calls(self.text, self.pos)
        deltas = []
        for call in calls:
            function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
            deltas.append(DeltaToolCall(index=self.count, id=self.call_id(), type="function", function=function))
            self.count += 1
        return [DeltaMessage(tool_calls=deltas)] if deltas else []

    def finish(self) -> tuple[list[DeltaMessage], list[DeltaToolCall]]:
        # The calls went out as their items completed; report whether there were any (for ``finish_reason``).
        return [], [DeltaToolCall(index=i) for i in range(self.count)]


class NamedToolMode(ToolMode):
    """A named function: the whole reply is its arguments (vLLM's behaviour for a forced function)."""

    def __init__(self, template_tools: list[dict[str, Any]], name: str) -> None:
        super().__init__(template_tools)
        self.name = name

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return None, [_tool_call(self.name, text)]

    def stream(self) -> Any:
        return _NamedStream(self.name)


class _NamedStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[DeltaMessage]:
        if self.started and not text:
            return []
        if self.started:
            call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))
        else:
            self.started = True
            function = DeltaFunctionCall(name=self.name, arguments=text)
            call = DeltaToolCall(index=0, id=random_id("call_"), type="function", function=function)
        return [DeltaMessage(tool_calls=[call])]

    def finish(self) -> tuple[list[DeltaMessage], list[DeltaToolCall]]:
        return ([] if self.started else self.feed("")), []


def _random_call_id() -> str:
    return random_id("call_")


def _tool_call(name: str, arguments: str, call_id: str | None = None) -> ToolCall:
    return ToolCall(id=call_id or _random_call_id(), function=FunctionCall(name=name, arguments=arguments))


def resolve_tool_mode(ctx: ServerContext, request: ChatCompletionRequest) -> ToolMode:
    """The request's tool mode; :class:`BadRequestError` for an inconsistent ``tools`` / ``tool_choice``."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise BadRequestError(
                "tool_choice needs tools: give the functions the model may call.", param="tool_choice"
            )
        return ToolMode()
    for index, tool in enumerate(tools):
        _check_parameters(tool.function.parameters, index)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolMode(template_tools)
    if isinstance(choice, NamedToolChoice):
        names = [tool.function.name for tool in tools]
        if choice.function.name not in names:
            raise BadRequestError(
                f"tool_choice names the function {choice.function.name!r}, which is not among the tools {names}.",
                param="tool_choice",
            )
        return NamedToolMode(template_tools, choice.function.name)
    if choice == "required":  # constrained to the JSON list of calls (structured outputs), whatever the server's parser
        from vllite.plugin_manager import resolve_component

        required_parser = resolve_component("tool_parsers", REQUIRED_FALLBACK_PARSER)
        return RequiredToolMode(template_tools, required_parser, server_parser=False)
    parser = ctx.tool_parser_class
    if choice == "auto" and (parser is None or not ctx.settings.enable_auto_tool_choice):
        raise BadRequestError(
            '"auto" tool choice needs a tool-call parser: start the server with --tool-call-parser NAME (hermes, '
            'qwen3_coder, mistral, llama3_json, ...). tool_choice defaults to "auto" when tools are given; send '
            '"none" to get plain text, or name a function to force its call.',
            param="tool_choice",
        )
    assert parser is not None
    return ParsedToolMode(template_tools, parser, tokenizer=ctx.tokenizer)


def _check_parameters(parameters: dict[str, Any] | None, index: int) -> None:
    """A function's ``parameters`` must be a JSON schema of an object."""
    if parameters is None:
        return
    where = f"tools[{index}].function.parameters"
    kind = parameters.get("type", "object")
    if kind != "object":
        raise BadRequestError(f"{where} must be a JSON schema of type 'object', got type {kind!r}.", param="tools")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, dict) for v in properties.values()):
        raise BadRequestError(f"{where}.properties must map each parameter name to a schema object.", param="tools")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not set(required) <= set(properties):
        raise BadRequestError(f"{where}.required must list names defined in properties.", param="tools")
