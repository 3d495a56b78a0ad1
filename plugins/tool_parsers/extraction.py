"""What a tool parser extracts from a finished turn, the JSON and pythonic call shapes the parsers share, and
``ToolCallStream``, the base of the per-request streaming extractors that each parser's ``stream()`` returns.

A parser's ``extract(text)`` gives ``ExtractedToolCalls``: the calls, in order, with their arguments re-serialized
as a JSON object (``"{}"`` when the model gave none), and the text outside the calls, stripped (None when empty).
A call that does not decode or has arguments that are not an object is not a call: its text stays in the content.

Streaming promise, for every split of a turn into deltas: the texts ``feed`` returned, then ``finish().content``,
make exactly ``extract(turn).content``, and ``finish().calls`` is ``extract(turn).calls``. So ``feed`` only
returns text that is content however the turn goes on: it withholds from where a call may be starting, the
turn's leading whitespace and any trailing whitespace (sent once more content follows it).
"""

from __future__ import annotations

import abc
import ast
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllite.exceptions import InternalStateError
from vllite.plugins.tool_parsers.scanners import PythonicHead

logger = logging.getLogger(__name__)

_MAX_NESTING = 8  # lists of lists of calls deeper than this are not calls


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments as JSON object text (``"{}"`` for none)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A turn split into its calls (in order; empty when it made none) and the content outside them (stripped,
    None when there is none)."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def extracted(content: str, calls: list[ToolCall]) -> ExtractedToolCalls:
    """``ExtractedToolCalls`` with ``content`` stripped, None when nothing is left."""
    return ExtractedToolCalls(content.strip() or None, calls)


def dumps_object(arguments: dict[str, Any]) -> str | None:
    """``arguments`` as strict JSON text (non-ASCII kept), or None when they cannot be (NaN, a set, ...)."""
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def arguments_json(value: Any) -> str | None:
    """A call's ``arguments``/``parameters`` value as JSON object text: a dict, a string holding a JSON object,
    or nothing (``None``, ``""``) for ``"{}"``. None when it is anything else (the call is then malformed)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "{}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    return dumps_object(value) if isinstance(value, dict) else None


def json_calls(value: Any, depth: int = 0) -> list[ToolCall]:
    """The calls in a decoded JSON value of an OpenAI-style shape: ``{"name", "arguments"/"parameters"}`` (or with
    ``"type": "function"/"function_call"``), ``{"function": {"name", "arguments"}}``, ``{"tool_calls": [...]}``,
    or a non-empty list of those. All or nothing: empty when any part is not a well-formed call."""
    if depth > _MAX_NESTING:
        return []
    if isinstance(value, list):
        calls: list[ToolCall] = []
        for item in value:
            item_calls = json_calls(item, depth + 1)
            if not item_calls:
                return []
            calls.extend(item_calls)
        return calls
    if not isinstance(value, dict):
        return []
    if isinstance(value.get("tool_calls"), list):
        return json_calls(value["tool_calls"], depth + 1)
    function = value.get("function")
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        call = _call(function["name"], function.get("arguments"))
        return [call] if call else []
    name = value.get("name")
    if isinstance(name, str) and (
        value.get("type") in ("function_call", "function") or "arguments" in value or "parameters" in value
    ):
        given = value["arguments"] if "arguments" in value else value.get("parameters")
        call = _call(name, given)
        return [call] if call else []
    return []


def _call(name: str, arguments: Any) -> ToolCall | None:
    text = arguments_json(arguments)
    return ToolCall(name, text) if name and text is not None else None


def pythonic_calls(body: str) -> list[ToolCall]:
    """The calls of a stripped pythonic call text: ``f(a=1)`` or ``[f(a=1), g.h(b="x")]``, the whole text, dotted
    names, keyword arguments with literal values only (re-serialized as JSON). All or nothing: empty otherwise."""
    if not body or PythonicHead(0).advance(body) != len(body):
        return []
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    calls = []
    for node in tree.elts if isinstance(tree, ast.List) else [tree]:
        call = _pythonic_call(node)
        if call is None:
            return []
        calls.append(call)
    return calls


def _pythonic_call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args or not _dotted_name(node.func):
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    text = dumps_object(arguments)
    return ToolCall(ast.unparse(node.func), text) if text is not None else None


def _dotted_name(node: ast.expr) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


class ToolCallStream(abc.ABC):
    """A per-request streaming extractor: ``feed`` each text delta of a turn, then call ``finish`` at its end.

    Promise (for every split of a turn into deltas): what ``feed`` returned, joined, then ``finish().content``,
    is exactly ``extract(turn).content``; ``finish().calls`` is ``extract(turn).calls``. Subclasses implement
    ``_release`` (most through :class:`AdvancingToolCallStream`); the base strips the content's ends and keeps the
    promise's bookkeeping.
    """

    def __init__(self, extract: Callable[[str], ExtractedToolCalls]) -> None:
        self._extract = extract
        self.text = ""  # the turn so far
        self.sent = ""  # the content feed has returned so far
        self._trailing_ws = ""  # content whitespace held back until more content follows it
        self._result: ExtractedToolCalls | None = None

    def feed(self, delta: str) -> str:
        """Adds ``delta`` to the turn; returns the content that is now safe to send (often ``""``)."""
        if self._result is not None:
            raise InternalStateError("ToolCallStream.feed after finish")
        if not delta:
            return ""
        self.text = _append(self, "text", delta)
        return self._release(delta)

    def finish(self) -> ExtractedToolCalls:
        """Ends the turn: the content not sent yet (None when none is left) and every call of the turn. Calling it
        again returns the same result."""
        if self._result is None:
            result = self._extract(self.text)
            content = result.content or ""
            if not content.startswith(self.sent):  # a bug in a stream's rules: never resend, never raise
                logger.error("ToolCallStream sent text that is not the turn's content; dropping the rest")
                content = self.sent
            self._result = ExtractedToolCalls(content[len(self.sent) :] or None, result.calls)
        return self._result

    @abc.abstractmethod
    def _release(self, delta: str) -> str:
        """The content to send now that ``delta`` was added to ``text``, recorded in ``sent``."""

    def _send(self, certain: str) -> str:
        """Sends ``certain`` content, less the turn's leading whitespace and any trailing whitespace (held back)."""
        pending = self._trailing_ws + certain
        if not self.sent:
            pending = pending.lstrip()
        body = pending.rstrip()
        self._trailing_ws = pending[len(body) :]
        self._record(body)
        return body

    def _record(self, body: str) -> None:
        """Adds ``body`` to ``sent``."""
        if body:
            self.sent = _append(self, "sent", body)


def _append(owner: object, attr: str, delta: str) -> str:
    """``getattr(owner, attr) + delta``, growing the string in place when possible: the attribute is cleared
    first so the local below is the only reference (CPython then appends without copying), keeping a long
    stream of small deltas linear instead of quadratic. The caller stores the result back."""
    text: str = getattr(owner, attr)
    setattr(owner, attr, "")
    text += delta
    return text


class AdvancingToolCallStream(ToolCallStream):
    """A stream that reads the text added since its last call and says which part became certain content."""

    def _release(self, delta: str) -> str:
        return self._send(self._advance())

    @abc.abstractmethod
    def _advance(self) -> str:
        """Reads the text added since the last call; returns the text that just became certain content (in
        order; whitespace included, the base strips the content's ends)."""
