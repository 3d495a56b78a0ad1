"""What every builtin tool-call parser shares: the parser base class (``parse`` names the calls ``extract`` finds),
the stream for formats whose calls can only begin at a marker, and the small text helpers behind them.

A parser family module (``tool_parsers``, ``tool_parsers_json``, ...) subclasses :class:`ToolParserBase` and
implements ``extract`` (never raises; a malformed call stays in the content) and ``stream`` (a
:class:`~vllite.plugins.tool_parsers.extraction.ToolCallStream` that agrees with ``extract`` however the turn is
split). A parser that sets ``accepts_tools = True`` is built as ``cls(tools=[...])`` by the server, with the
request's OpenAI tool definitions (to convert argument values by their schema types).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

from vllite.plugins.tool_parsers.extraction import (
    AdvancingToolCallStream,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    extracted,
)

MULTI_TOOL = "multi_tool"


def combine_names(names: list[str]) -> str | None:
    """The one tool ``names`` call, ``"multi_tool"`` for several different ones, None for none."""
    distinct = list(dict.fromkeys(n for n in names if n))
    if not distinct:
        return None
    return distinct[0] if len(distinct) == 1 else MULTI_TOOL


def partial_suffix(text: str, marker: str, lo: int) -> int:
    """The length of the longest proper prefix of ``marker`` that ``text`` ends with, starting at ``lo`` or later."""
    for k in range(min(len(marker) - 1, len(text) - lo), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolParserBase(abc.ABC):
    """What every parser shares: ``parse`` names the calls ``extract`` finds.

    Class attributes the server reads: ``accepts_tools`` (build the parser as ``cls(tools=...)``),
    ``skip_special_tokens`` (``False``: the format's markers are special tokens, so a request with tools is
    detokenized with them, as vLLM's ``adjust_request`` does) and ``tool_call_id()`` (the id of a returned call).
    """

    accepts_tools: ClassVar[bool] = False
    skip_special_tokens: ClassVar[bool | None] = None

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def parse(self, text: str) -> str | None:
        """The tool the turn calls: its name, ``"multi_tool"`` for calls of different tools, None for no call."""
        return self._tool_name(self.extract(text).calls)

    @abc.abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The turn's calls and the content outside them; never raises on malformed text."""

    @abc.abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh streaming extractor for one turn (see ``ToolCallStream`` for its promise)."""

    def _tool_name(self, calls: list[ToolCall]) -> str | None:
        return combine_names([call.name for call in calls])


class MarkerStream(AdvancingToolCallStream):
    """Sends the text before the first ``marker`` (holding back a partial one at the end), then holds back the rest:
    for formats whose calls can only start at the marker and whose fate is known only at the end of the turn."""

    def __init__(self, parser: ToolParserBase, marker: str) -> None:
        super().__init__(parser.extract)
        self._marker = marker
        self._pos = 0  # the text before this is sent (or held as trailing whitespace)
        self._scan = 0  # where the search for the marker resumes
        self._marker_at: int | None = None

    def _find_marker(self) -> int | None:
        if self._marker_at is None:
            at = self.text.find(self._marker, self._scan)
            if at >= 0:
                self._marker_at = at
            else:
                self._scan = max(self._scan, len(self.text) - len(self._marker) + 1)
        return self._marker_at

    def _advance(self) -> str:
        text, at = self.text, self._find_marker()
        if at is None:
            at = len(text) - partial_suffix(text, self._marker, self._pos)
        certain = text[self._pos : at]
        self._pos = max(self._pos, at)
        return certain


BlockCalls = Callable[[str], list[ToolCall]]


def extract_blocks(text: str, opener: str, closer: str, block_calls: BlockCalls) -> ExtractedToolCalls:
    """The calls of every ``opener … closer`` block whose body ``block_calls`` reads as calls, and the text outside
    them; a block that is not a call (and an unclosed one) stays in the content."""
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(opener, pos)) >= 0:
        end = text.find(closer, start + len(opener))
        if end < 0:
            break
        stop = end + len(closer)
        found = block_calls(text[start + len(opener) : end])
        pieces.append(text[pos:start] if found else text[pos:stop])
        calls.extend(found)
        pos = stop
    pieces.append(text[pos:])
    return extracted("".join(pieces), calls)


class BlockStream(AdvancingToolCallStream):
    """The stream of :func:`extract_blocks`: sends text outside blocks as it comes, holding back from each
    ``opener`` (or a partial one at the end) until its ``closer``: a call is then dropped, anything else sent."""

    def __init__(
        self, extract: Callable[[str], ExtractedToolCalls], opener: str, closer: str, block_calls: BlockCalls
    ) -> None:
        super().__init__(extract)
        self._opener, self._closer, self._block_calls = opener, closer, block_calls
        self.has_call = False  # a well-formed block was read: the turn has a call whatever follows
        self._pos = 0  # the text before this is settled
        self._block: int | None = None  # where the open block starts

    def _advance(self) -> str:
        text, certain = self.text, []
        opener, closer = self._opener, self._closer
        while True:
            if self._block is None:
                start = text.find(opener, self._pos)
                if start < 0:
                    safe = len(text) - partial_suffix(text, opener, self._pos)
                    certain.append(text[self._pos : safe])
                    self._pos = safe
                    break
                certain.append(text[self._pos : start])
                self._block, self._pos = start, start + len(opener)
            end = text.find(closer, self._pos)
            if end < 0:
                self._pos = max(self._pos, len(text) - len(closer) + 1)
                break
            stop = end + len(closer)
            if self._block_calls(text[self._block + len(opener) : end]):
                self.has_call = True
            else:
                certain.append(text[self._block : stop])
            self._block, self._pos = None, stop
        return "".join(certain)
