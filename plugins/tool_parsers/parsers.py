"""Tool-call parsers: name the tool a finished agent turn calls (``parse``, for the Continuum scheduler), extract
its calls (``extract``) and do so while it streams (``stream``, for the OpenAI server's ``--tool-call-parser``).

- ``bash``: mini-swe-agent — exactly one ```` ```bash ```` block; the call is ``bash`` with
  ``{"command": <block body>}``, the content the text around the block. ``parse`` names the command's first word
  (``ls``, ``pytest``).
- ``openai``: JSON function calls — ``{"type": "function_call", "name": ...}``, ``{"name": ..., "arguments":
  ...}`` (Qwen, Llama-3.1 JSON with ``parameters``), ``{"tool_calls": [{"function": {"name": ...}}]}``, or a list:
  the whole text, else every such JSON value in it.
- ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks; the content is the text outside.
- ``llama``: Llama pythonic calls ``func(arg=...)`` or ``[f(a=1), g(b=2)]``, keyword arguments with literal values
  only, optionally after ``<|python_tag|>`` (the content is then the text before it).
- ``auto``: hermes, openai, llama, then bash; the first that finds a call wins.

Several calls of one tool name that tool; calls of different tools give ``"multi_tool"``. No call gives None.
Malformed calls (bad JSON, non-literal or positional arguments, arguments that are not an object) are no calls:
their text stays in the content. The Continuum scheduler only parses when the client did not send
``this_func_call`` (which always wins). Streams: see ``vllite.plugins.tool_parsers.extraction``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vllite.plugins.tool_parsers.base import (
    MULTI_TOOL,
    BlockStream,
    MarkerStream,
    ToolParserBase,
    extract_blocks,
)
from vllite.plugins.tool_parsers.extraction import (
    AdvancingToolCallStream,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    extracted,
    json_calls,
    pythonic_calls,
)
from vllite.plugins.tool_parsers.scanners import JSONPrefix, PythonicHead

__all__ = [
    "MAX_TEXT_CHARS",
    "MULTI_TOOL",
    "PARSERS",
    "AutoParser",
    "BashParser",
    "ExtractedToolCalls",
    "HermesParser",
    "LlamaPythonicParser",
    "OpenAIJSONParser",
    "ToolCall",
    "ToolCallStream",
]

MAX_TEXT_CHARS = 200_000  # ``AutoParser.parse`` skips longer texts (a turn that long is not a tool call worth timing)

_BASH_BLOCK = re.compile(r"```bash\s*\n(.*?)\n```", re.DOTALL)
_BASH_MARK = "```bash"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_JSON_START = re.compile(r"[\[{]")
# How a JSON call value starts: an object with a key, or lists (as deep as ``json_calls`` reads) around one.
_JSON_CALL_START = re.compile(r'\{[ \t\n\r]*"|\[[ \t\n\r]*(?:\[[ \t\n\r]*){0,8}\{')
_NON_SPACE = re.compile(r"\S")
_DECODER = json.JSONDecoder()


class BashParser(ToolParserBase):
    """mini-swe-agent's convention (the released fork's only parser): exactly one bash block is a ``bash`` call
    with ``{"command": <the block's stripped body>}``; ``parse`` names the command's first word."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """One call for exactly one non-empty bash block, the text around it as content; else no call."""
        blocks = list(_BASH_BLOCK.finditer(text))
        if len(blocks) == 1:
            block = blocks[0]
            command = block.group(1).strip()
            if command:
                call = ToolCall("bash", json.dumps({"command": command}, ensure_ascii=False))
                return extracted(text[: block.start()] + text[block.end() :], [call])
        return extracted(text, [])

    def stream(self) -> ToolCallStream:
        """Sends the text before the first ```` ```bash ````, then holds the rest back to the end of the turn."""
        return MarkerStream(self, _BASH_MARK)

    def _tool_name(self, calls: list[ToolCall]) -> str | None:
        words = json.loads(calls[0].arguments)["command"].split() if calls else []
        return words[0] if words else None


class OpenAIJSONParser(ToolParserBase):
    """OpenAI-style JSON function calls: the whole text as one JSON value, else every JSON value in it that is a
    call (left to right; a value that is not a call may hold one)."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls and the text outside them. When the whole text is one JSON value, it is a call or content."""
        try:
            whole = json.loads(text.strip())
        except (ValueError, RecursionError):
            pass
        else:
            calls = json_calls(whole)
            return ExtractedToolCalls(None, calls) if calls else extracted(text, [])
        pieces: list[str] = []
        calls, pos = [], 0
        for match in _JSON_START.finditer(text):
            start = match.start()
            if start < pos:
                continue
            value_calls, end = _json_calls_at(text, start)
            if value_calls:
                pieces.append(text[pos:start])
                calls.extend(value_calls)
                pos = end
        pieces.append(text[pos:])
        return extracted("".join(pieces), calls)

    def stream(self) -> ToolCallStream:
        """Sends text up to the first ``{``/``[`` that may still begin a call; holds everything back from the first
        call found."""
        return _OpenAIStream(self)


def _json_calls_at(text: str, start: int) -> tuple[list[ToolCall], int]:
    """The calls in the JSON value at ``start`` (empty when none) and where that value ends."""
    if not _JSON_CALL_START.match(text, start):  # cheap: most braces in prose and code are not calls
        return [], start
    try:
        value, end = _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return [], start
    return json_calls(value), end


class _OpenAIStream(AdvancingToolCallStream):
    def __init__(self, parser: OpenAIJSONParser) -> None:
        super().__init__(parser.extract)
        self._pos = 0  # the text before this is sent
        self._scan = 0  # where to look for the next candidate
        self._candidate: JSONPrefix | None = None
        self._found = False

    def _advance(self) -> str:
        if self._found:
            return ""
        text = self.text
        while True:
            if self._candidate is None:
                match = _JSON_START.search(text, self._scan)
                if match is None:
                    safe = self._scan = len(text)
                    break
                self._candidate = JSONPrefix(match.start())
            start, end = self._candidate.start, self._candidate.advance(text)
            if end is None or (end > 0 and _json_calls_at(text, start)[0]):
                self._found = end is not None
                safe = start
                break
            self._candidate, self._scan = None, start + 1  # not a call; a call may still start inside it
        certain, self._pos = text[self._pos : safe], safe
        return certain


class HermesParser(ToolParserBase):
    """Hermes / Qwen ``<tool_call>{json}</tool_call>`` blocks; a block that is not a call stays in the content."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls of the well-formed blocks and the text outside them."""
        return extract_blocks(text, _HERMES_OPEN, _HERMES_CLOSE, _hermes_calls)

    def stream(self) -> ToolCallStream:
        """Sends text outside blocks as it comes, holding back from each ``<tool_call>`` (or a partial one at the
        end) until its ``</tool_call>``: a call is then dropped, anything else sent."""
        return BlockStream(self.extract, _HERMES_OPEN, _HERMES_CLOSE, _hermes_calls)


def _hermes_calls(body: str) -> list[ToolCall]:
    try:
        return json_calls(json.loads(body.strip()))
    except (ValueError, RecursionError):
        return []


class LlamaPythonicParser(ToolParserBase):
    """Llama 3.2+ pythonic calls: the text (after an optional ``<|python_tag|>``) is ``f(a=1)`` or a list of such
    calls, keyword arguments with literal values only (they become the JSON arguments)."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls, with the text before ``<|python_tag|>`` as content; no call unless the whole rest is calls."""
        before, tag, body = text.partition(_PYTHON_TAG)
        if not tag:
            before, body = "", text
        calls = pythonic_calls(body.strip())
        return extracted(before, calls) if calls else extracted(text, [])

    def stream(self) -> ToolCallStream:
        """Holds the turn back while it may still be a bare call; else sends the text before ``<|python_tag|>``
        (holding back a partial one at the end), then holds the rest back to the end of the turn."""
        return _LlamaStream(self)


class _LlamaStream(MarkerStream):
    def __init__(self, parser: LlamaPythonicParser) -> None:
        super().__init__(parser, _PYTHON_TAG)
        self._head: PythonicHead | None = None
        self._head_end: int | None = None
        self._bare_call = True  # the turn so far may still be a bare call (no tag)

    def _advance(self) -> str:
        if self._bare_call and self._find_marker() is None:
            self._bare_call = self._may_be_bare_call()
            if self._bare_call:
                return ""
        return super()._advance()

    def _may_be_bare_call(self) -> bool:
        text = self.text
        if self._head is None:
            first = _NON_SPACE.search(text)
            if first is None:
                return True
            self._head = PythonicHead(first.start())
        if self._head_end is None:
            end = self._head.advance(text)
            if end is None:
                return True
            self._head_end = end
        return self._head_end > 0 and not text[self._head_end :].strip()


class AutoParser(ToolParserBase):
    """Tries hermes, openai, llama and bash in turn; the first that finds a call wins."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.parsers: tuple[ToolParserBase, ...] = (
            HermesParser(),
            OpenAIJSONParser(),
            LlamaPythonicParser(),
            BashParser(),
        )

    def parse(self, text: str) -> str | None:
        """As ``ToolParserBase.parse``, by the winning parser's rule (bash names the command); None beyond
        ``MAX_TEXT_CHARS``."""
        if not text or len(text) > MAX_TEXT_CHARS:
            return None
        for parser in self.parsers:
            calls = parser.extract(text).calls
            if calls:
                return parser._tool_name(calls)
        return None

    def extract(self, text: str) -> ExtractedToolCalls:
        """The first parser's extraction that has calls; else no call, the whole text as content."""
        for parser in self.parsers:
            result = parser.extract(text)
            if result.calls:
                return result
        return extracted(text, [])

    def stream(self) -> ToolCallStream:
        """Sends what every parser's stream has sent (all of it the start of the turn's text), or once a hermes
        block is a call, what the hermes stream sends."""
        return _AutoStream(self)


class _AutoStream(ToolCallStream):
    def __init__(self, parser: AutoParser) -> None:
        super().__init__(parser.extract)
        self._streams = [p.stream() for p in parser.parsers]

    def _release(self, delta: str) -> str:
        for stream in self._streams:
            stream.feed(delta)
        hermes = self._streams[0]
        lead: ToolCallStream
        if isinstance(hermes, BlockStream) and hermes.has_call:
            lead = hermes
        else:
            lead = min(self._streams, key=lambda stream: len(stream.sent))
        new = lead.sent[len(self.sent) :]
        self._record(new)
        return new


PARSERS: dict[str, type[ToolParserBase]] = {
    "auto": AutoParser,
    "bash": BashParser,
    "openai": OpenAIJSONParser,
    "hermes": HermesParser,
    "llama": LlamaPythonicParser,
}
