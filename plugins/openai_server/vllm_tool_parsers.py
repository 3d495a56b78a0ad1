"""vLLM tool-parser plugins without vLLM: the ``ToolParser`` / ``ToolParserManager`` API and the protocol classes a
vLLM parser returns, served by the vLLM compatibility layer at vLLM's module paths.

A ``--tool-parser-plugin`` file written for vLLM subclasses :class:`ToolParser` and decorates it with
``@ToolParserManager.register_module(["name"])``. The decorator records an *adapter* class (:func:`adapter_for`):
a vllite tool parser (``extract`` / ``stream`` / ``parse``, see :class:`~vllite.plugins.tool_parsers.base.
ToolParserBase`) that builds the vLLM parser and calls it. ``load_parser_plugin`` then registers the file's adapters
(:func:`registrations`) under those names, so ``--tool-call-parser name`` selects them.

How the adapter calls the vLLM parser:

- ``extract(text)`` calls ``extract_tool_calls(text, request)`` once for the whole turn.
- ``stream()`` calls ``extract_tool_calls_streaming(previous_text, current_text, delta_text, previous_token_ids,
  current_token_ids, delta_token_ids, request)`` for each delta of one parser instance; vllite's stream has text
  only, so the three token-id arguments are always empty lists. Streamed ``content`` is sent as it comes; the calls
  are assembled from the streamed ``DeltaToolCall`` pieces (by ``index``: the name, the argument fragments joined)
  and returned when the turn ends (vllite sends a turn's calls in its last chunk); when the stream gave no call
  (or the parser raised), the calls are those ``extract_tool_calls`` finds in the whole turn.
- ``tokenizer``: the server's tokenizer (the adapter sets ``accepts_tokenizer``); ``None`` where no tokenizer is
  at hand (the Continuum scheduler's ``parse`` in the engine-core process).
- ``request``: a :class:`ChatCompletionRequest` carrying the request's ``tools`` (and an empty user message), not
  the client's request itself.

A parser that raises is logged and treated as having found no call (the text stays content).
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from vllite.hookspecs import hookimpl
from vllite.plugins.openai_server.protocol import ChatCompletionRequest
from vllite.plugins.tool_parsers.base import ToolParserBase
from vllite.plugins.tool_parsers.extraction import (
    ExtractedToolCalls,
    ToolCallStream,
    arguments_json,
    extracted,
)
from vllite.plugins.tool_parsers.extraction import ToolCall as VlliteToolCall

logger = logging.getLogger(__name__)

__all__ = [
    "ChatCompletionRequest",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCallInformation",
    "FunctionCall",
    "ToolCall",
    "ToolParser",
    "ToolParserManager",
    "adapter_for",
    "registrations",
]


# ---------------------------------------------------------------- vLLM's protocol classes (the fields parsers use)
class FunctionCall(BaseModel):
    """A called function's name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One complete tool call a parser found."""

    id: str = Field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    """A streamed piece of a function call: its name, or a fragment of its arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of the tool call at ``index``."""

    id: str | None = None
    type: str | None = None
    index: int
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    """What a streaming parser returns for one delta: content and tool-call pieces."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ExtractedToolCallInformation(BaseModel):
    """What ``extract_tool_calls`` returns for a whole reply."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


# ---------------------------------------------------------------- vLLM's parser API
class ToolParser:
    """vLLM's tool-parser base: the state its streaming parsers keep, and the two methods a parser implements."""

    def __init__(self, tokenizer: Any) -> None:
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        self.streamed_args_for_tool: list[str] = []
        self.model_tokenizer = tokenizer

    @cached_property
    def vocab(self) -> dict[str, int]:
        vocab: dict[str, int] = self.model_tokenizer.get_vocab()
        return vocab

    def adjust_request(self, request: Any) -> Any:
        return request

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        raise NotImplementedError(f"{type(self).__name__} does not implement extract_tool_calls")

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        raise NotImplementedError(f"{type(self).__name__} does not implement extract_tool_calls_streaming")


#: module name -> [(parser name, adapter class)], in registration order: what :func:`registrations` hands out.
_REGISTERED: dict[str, list[tuple[str, type]]] = {}


class ToolParserManager:
    """vLLM's registry of tool parsers: ``register_module`` also records a vllite adapter for each name."""

    tool_parsers: ClassVar[dict[str, type]] = {}

    @classmethod
    def get_tool_parser(cls, name: str) -> type:
        if name not in cls.tool_parsers:
            raise KeyError(f"tool helper: {name!r} not found in tool_parsers")
        return cls.tool_parsers[name]

    @classmethod
    def register_module(
        cls, name: str | list[str] | None = None, force: bool = True, module: type | None = None
    ) -> Any:
        """Registers ``module`` (or, used as a decorator, the decorated class) under ``name`` (one name or a list;
        the class name when ``None``)."""

        def register(parser: type) -> type:
            names = [parser.__name__] if name is None else [name] if isinstance(name, str) else list(name)
            for each in names:
                if not force and each in cls.tool_parsers:
                    raise KeyError(f"{each} is already registered at {cls.tool_parsers[each].__module__}")
                cls.tool_parsers[each] = parser
                entries = _REGISTERED.setdefault(parser.__module__, [])
                entries[:] = [(n, a) for n, a in entries if n != each]
                entries.append((each, adapter_for(parser)))
            return parser

        return register(module) if module is not None else register


def registrations(module_name: str) -> list[tuple[str, type]]:
    """The ``(name, adapter class)`` pairs the module ``module_name`` registered with ``register_module``."""
    return list(_REGISTERED.get(module_name, []))


class VllmToolParsersPlugin:
    """The vllite plugin of one vLLM-style parser file: registers its adapters as tool parsers."""

    def __init__(self, entries: list[tuple[str, type]]) -> None:
        self.entries = entries

    @hookimpl
    def vllite_register_tool_parsers(self, register: Callable[[str, Any], None]) -> None:
        for name, adapter in self.entries:
            register(name, adapter)


def plugin_for(module_name: str) -> VllmToolParsersPlugin | None:
    """The plugin object registering what ``module_name`` registered with vLLM's API (None: it registered none)."""
    entries = registrations(module_name)
    return VllmToolParsersPlugin(entries) if entries else None


# ---------------------------------------------------------------- the adapter: a vllite tool parser over a vLLM one
class VllmToolParserAdapter(ToolParserBase):
    """A vllite tool parser that runs the vLLM parser :attr:`vllm_parser` (see the module docstring)."""

    accepts_tools: ClassVar[bool] = True
    accepts_tokenizer: ClassVar[bool] = True
    vllm_parser: ClassVar[type]

    def __init__(self, tools: list[dict[str, Any]] | None = None, tokenizer: Any = None) -> None:
        super().__init__(tools)
        self.tokenizer = tokenizer

    def new_parser(self) -> Any:
        """A fresh vLLM parser (its streaming state is per turn)."""
        return self.vllm_parser(self.tokenizer)

    def request(self) -> ChatCompletionRequest:
        """The request the vLLM parser gets: the tools, and an empty user message."""
        messages = [{"role": "user", "content": ""}]
        return ChatCompletionRequest.model_validate({"messages": messages, "tools": self.tools or None})

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            info = self.new_parser().extract_tool_calls(text, self.request())
        except Exception:
            logger.exception("tool parser %s failed on a reply; it stays content", self.vllm_parser.__name__)
            return extracted(text, [])
        calls = [_call(c.function.name, c.function.arguments) for c in info.tool_calls] if info.tools_called else []
        if not calls:
            return extracted(text, [])
        return extracted(info.content or "", calls)

    def stream(self) -> ToolCallStream:
        return _VllmStream(self)


def adapter_for(parser: type) -> type:
    """The :class:`VllmToolParserAdapter` subclass that runs the vLLM parser class ``parser``."""
    name = f"{parser.__name__}VlliteAdapter"
    doc = f"vllite's adapter for the vLLM tool parser {parser.__qualname__}."
    attrs = {"vllm_parser": parser, "__doc__": doc, "__module__": parser.__module__, "__qualname__": name}
    adapter = type(name, (VllmToolParserAdapter,), attrs)
    module = sys.modules.get(parser.__module__)
    if module is not None:  # named by class path ("file_module:NameVlliteAdapter"), as Continuum's engine core does
        setattr(module, name, adapter)
    return adapter


def _call(name: str, arguments: str | None) -> VlliteToolCall:
    return VlliteToolCall(name, arguments_json(arguments) or arguments or "{}")


class _VllmStream(ToolCallStream):
    """Feeds each delta to one vLLM parser's ``extract_tool_calls_streaming`` (token ids: empty lists)."""

    def __init__(self, adapter: VllmToolParserAdapter) -> None:
        super().__init__(adapter.extract)
        self._adapter = adapter
        self._parser = adapter.new_parser()
        self._request = adapter.request()
        self._calls: dict[int, list[str]] = {}  # index -> [name, arguments so far]
        self._failed = False

    def _release(self, delta: str) -> str:
        if self._failed:
            return ""
        previous = self.text[: len(self.text) - len(delta)]
        try:
            message = self._parser.extract_tool_calls_streaming(previous, self.text, delta, [], [], [], self._request)
        except Exception:
            logger.exception("tool parser %s failed on a streamed delta", self._adapter.vllm_parser.__name__)
            self._failed = True  # from here the turn's end decides, through extract()
            return ""
        if message is None:
            return ""
        if isinstance(message, dict):
            message = DeltaMessage.model_validate(message)
        for piece in message.tool_calls or []:
            if isinstance(piece, dict):
                piece = DeltaToolCall.model_validate(piece)
            call = self._calls.setdefault(piece.index, ["", ""])
            if piece.function is not None:
                call[0] += piece.function.name or ""
                call[1] += piece.function.arguments or ""
        return self._send(message.content or "")

    def finish(self) -> ExtractedToolCalls:
        if self._result is None:
            whole = self._extract(self.text)
            content = whole.content or ""
            rest = content[len(self.sent) :] if content.startswith(self.sent) else ""
            calls = [_call(name, args) for _, (name, args) in sorted(self._calls.items()) if name]
            if self._failed or not calls:
                calls = whole.calls
            self._result = ExtractedToolCalls(rest or None, calls)
        return self._result
