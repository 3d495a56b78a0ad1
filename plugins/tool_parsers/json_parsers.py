"""Tool-call parsers for the families that write their calls as JSON after a marker token (vLLM's names):

- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizers before v11), or one call per
  marker, ``[TOOL_CALLS]name{...}`` (v11) and ``[TOOL_CALLS]name[ARGS]{...}`` (v13, optionally with
  ``[CALL_ID]id`` before ``[ARGS]``). The content is the text before the first ``[TOOL_CALLS]``; call ids are nine
  alphanumeric characters, as Mistral's chat templates require of the next turn.
- ``llama3_json`` (also ``llama4_json``): the turn, after an optional ``<|python_tag|>``, is one JSON call
  ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) or several separated by ``;``; the content is the
  text before the tag.
- ``granite``: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`` (Granite 3.x); the marker is a special
  token, so a reply detokenized without it is read from a bare leading ``[``.

All or nothing: when anything after the marker is not a well-formed call, the whole turn is content. The markers
are special tokens in these models' tokenizers, so the server keeps special tokens in the text of a request with
tools (``skip_special_tokens = False``), as vLLM does.
"""

from __future__ import annotations

import abc
import json
import random
import re
import string
from typing import Any

from vllite.plugins.tool_parsers.base import MarkerStream, ToolParserBase
from vllite.plugins.tool_parsers.extraction import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    arguments_json,
    extracted,
    json_calls,
)

_DECODER = json.JSONDecoder()
_NON_SPACE = re.compile(r"\S")
_MISTRAL_MARK = "[TOOL_CALLS]"
_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?(?:\[ARGS\])?\s*(?=\{)")
_PYTHON_TAG = "<|python_tag|>"
_GRANITE_MARK = "<|tool_call|>"
_ID_CHARS = string.ascii_letters + string.digits


def _decode_all(body: str) -> Any:
    """The one JSON value ``body`` holds (whitespace around it allowed), or None when it is anything else."""
    first = _NON_SPACE.search(body)
    if first is None:
        return None
    try:
        value, end = _DECODER.raw_decode(body, first.start())
    except (ValueError, RecursionError):
        return None
    return value if not body[end:].strip() else None


class MistralParser(ToolParserBase):
    """Mistral's ``[TOOL_CALLS]`` calls, in the JSON-list (pre-v11) and the name-then-arguments (v11+) forms."""

    skip_special_tokens = False

    @staticmethod
    def tool_call_id() -> str:
        """Nine alphanumeric characters: what Mistral's chat templates accept as a call id in the next turn."""
        return "".join(random.choices(_ID_CHARS, k=9))

    def extract(self, text: str) -> ExtractedToolCalls:
        """Every call after the first ``[TOOL_CALLS]``, the text before it as content; no call unless every
        segment after a marker is a well-formed call (or list of calls)."""
        at = text.find(_MISTRAL_MARK)
        if at < 0:
            return extracted(text, [])
        calls: list[ToolCall] = []
        for segment in text[at + len(_MISTRAL_MARK) :].split(_MISTRAL_MARK):
            found = _mistral_segment_calls(segment.strip())
            if not found:
                return extracted(text, [])
            calls.extend(found)
        return extracted(text[:at], calls)

    def stream(self) -> ToolCallStream:
        """Sends the text before ``[TOOL_CALLS]`` (holding back a partial one), then holds the rest to the end."""
        return MarkerStream(self, _MISTRAL_MARK)


def _mistral_segment_calls(segment: str) -> list[ToolCall]:
    if segment.startswith(("[", "{")):
        value = _decode_all(segment)
        return json_calls(value) if isinstance(value, (list, dict)) else []
    named = _MISTRAL_NAMED.match(segment)
    if named is None:
        return []
    arguments = _decode_all(segment[named.end() :])
    text = arguments_json(arguments) if isinstance(arguments, dict) else None
    return [ToolCall(named.group(1), text)] if text is not None else []


def _semicolon_calls(body: str) -> list[ToolCall]:
    """``{call}; {call}; ...``: JSON call objects separated by ``;``, the whole (stripped) body. All or nothing."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        try:
            value, pos = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return []
        found = json_calls(value) if isinstance(value, dict) and "name" in value else []
        if not found:
            return []
        calls.extend(found)
        rest = _NON_SPACE.search(body, pos)
        if rest is None:
            return calls
        if body[rest.start()] != ";":
            return []
        following = _NON_SPACE.search(body, rest.start() + 1)
        if following is None:
            return []
        pos = following.start()


def _list_calls(body: str) -> list[ToolCall]:
    """A JSON list of calls, the whole (stripped) body."""
    value = _decode_all(body) if body.startswith("[") else None
    return json_calls(value) if isinstance(value, list) else []


class _TaggedJSONParser(ToolParserBase):
    """Calls that fill the rest of the turn after ``tag`` (the content is the text before it), or the whole turn
    when it starts with ``bare_start`` (the tag stripped as a special token)."""

    tag: str = ""
    bare_start: str = ""

    @abc.abstractmethod
    def _body_calls(self, body: str) -> list[ToolCall]:
        """The calls of the stripped text after the tag (all or nothing)."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls after the tag (or of the whole bare turn), the text before the tag as content."""
        before, tag, body = text.partition(self.tag)
        if not tag:
            before, body = "", text
        calls = self._body_calls(body.strip())
        return extracted(before, calls) if calls else extracted(text, [])

    def stream(self) -> ToolCallStream:
        """Holds the turn back while it may still be a bare call (it starts with ``bare_start``); else sends the text
        before the tag (holding back a partial one), then holds the rest back to the end of the turn."""
        return _TaggedStream(self)


class _TaggedStream(MarkerStream):
    def __init__(self, parser: _TaggedJSONParser) -> None:
        super().__init__(parser, parser.tag)
        self._bare_start = parser.bare_start
        self._bare: bool | None = None  # the turn starts like a bare call (None: only whitespace so far)

    def _advance(self) -> str:
        if self._bare is None:
            first = _NON_SPACE.search(self.text)
            if first is not None:
                self._bare = self.text[first.start()] == self._bare_start
        if self._bare is not False and self._find_marker() is None:
            return ""
        return super()._advance()


class Llama3JSONParser(_TaggedJSONParser):
    """Llama 3.x / 4 JSON calls: ``{"name": ..., "parameters": {...}}``, several separated by ``;``, the whole turn
    or after ``<|python_tag|>``."""

    tag = _PYTHON_TAG
    bare_start = "{"

    def _body_calls(self, body: str) -> list[ToolCall]:
        return _semicolon_calls(body)


class GraniteParser(_TaggedJSONParser):
    """Granite 3.x calls: a JSON list of ``{"name": ..., "arguments": {...}}`` after ``<|tool_call|>`` (or bare)."""

    tag = _GRANITE_MARK
    bare_start = "["
    skip_special_tokens = False

    def _body_calls(self, body: str) -> list[ToolCall]:
        return _list_calls(body)
