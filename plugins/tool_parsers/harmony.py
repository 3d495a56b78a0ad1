"""The ``openai`` tool-call parser: gpt-oss's harmony format (vLLM's ``--tool-call-parser openai``), and the
OpenAI-style JSON calls this name always read in vllite.

A turn that starts with a harmony header (``<|channel|>`` or ``<|start|>``) is read as harmony messages::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(one line in the model's output).

A message whose header names a recipient ``to=functions.NAME`` and whose body is a JSON object is a call; every
other message gives its body to the content (bodies joined by a newline; use ``--reasoning-parser openai_gptoss`` to
take the analysis channel out as reasoning). A call message with a malformed body, a message to another recipient,
and text outside any message stay in the content as written. The markers are special tokens, so the server keeps
special tokens in a request's text when this parser reads it (``skip_special_tokens = False``). Any other turn is
read as JSON calls (:class:`~vllite.plugins.tool_parsers.parsers.OpenAIJSONParser`).
"""

from __future__ import annotations

import re

from vllite.plugins.tool_parsers.base import ToolParserBase, partial_suffix
from vllite.plugins.tool_parsers.extraction import (
    AdvancingToolCallStream,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    arguments_json,
    extracted,
)
from vllite.plugins.tool_parsers.parsers import OpenAIJSONParser

HARMONY_STARTS = ("<|channel|>", "<|start|>")
MESSAGE = "<|message|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_TERMINATOR = re.compile("|".join(re.escape(t) for t in TERMINATORS))
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."


def is_harmony(text: str) -> bool:
    """Whether ``text`` (leading whitespace aside) begins with a harmony message header."""
    return text.lstrip().startswith(HARMONY_STARTS)


class _HarmonyScanner:
    """Reads harmony messages from a growing text, deciding each piece only once it is certain (or ``final``)."""

    def __init__(self) -> None:
        self.pos = 0  # the text before this is settled
        self.body_from: int | None = None  # inside a content message: its body before this is sent
        self.parts = 0  # content parts started (a newline goes before every part but the first)
        self.calls: list[ToolCall] = []

    def _separator(self) -> str:
        self.parts += 1
        return "\n" if self.parts > 1 else ""

    def advance(self, text: str, final: bool) -> str:
        """Reads from where the last call stopped; returns the content that became certain."""
        out: list[str] = []
        while True:
            if self.body_from is not None:
                if not self._body(text, final, out):
                    break
                continue
            if self.pos >= len(text):
                break
            term = _TERMINATOR.search(text, self.pos)
            at = text.find(MESSAGE, self.pos)
            if at >= 0 and (term is None or at < term.start()):
                has_channel = text.find(HARMONY_STARTS[0], self.pos, at) >= 0
                recipient = _RECIPIENT.search(text, self.pos, at)
                if has_channel and recipient is None:
                    out.append(self._separator())
                    self.body_from = at + len(MESSAGE)
                    continue
                if term is None and not final:
                    break
                end = term.end() if term else len(text)
                body = text[at + len(MESSAGE) : term.start() if term else end]
                call = _call(recipient.group(1), body) if has_channel and recipient is not None else None
                if call is not None:
                    self.calls.append(call)
                else:
                    out.append(self._separator() + text[self.pos : end])
                self.pos = end
                continue
            if term is None and not final:
                break
            end = term.end() if term else len(text)
            if text[self.pos : end].strip():
                out.append(self._separator() + text[self.pos : end])
            self.pos = end
        return "".join(out)

    def _body(self, text: str, final: bool, out: list[str]) -> bool:
        """Sends a content message's body up to its terminator; False when it must wait for more text."""
        assert self.body_from is not None
        term = _TERMINATOR.search(text, self.body_from)
        if term is not None:
            out.append(text[self.body_from : term.start()])
            self.pos, self.body_from = term.end(), None
            return True
        held = 0 if final else max(partial_suffix(text, t, self.body_from) for t in TERMINATORS)
        out.append(text[self.body_from : len(text) - held])
        self.body_from = len(text) - held
        if final:
            self.pos, self.body_from = len(text), None
        return False


def _call(recipient: str, body: str) -> ToolCall | None:
    if not recipient.startswith(_FUNCTIONS) or len(recipient) == len(_FUNCTIONS):
        return None
    arguments = arguments_json(body)
    return ToolCall(recipient[len(_FUNCTIONS) :], arguments) if arguments is not None else None


def extract_harmony(text: str) -> ExtractedToolCalls:
    """The calls of a harmony turn and the content of its other messages."""
    scanner = _HarmonyScanner()
    content = scanner.advance(text, final=True)
    return extracted(content, scanner.calls)


class OpenAIParser(ToolParserBase):
    """gpt-oss harmony calls (``to=functions.NAME``), or OpenAI-style JSON calls for a turn that is not harmony."""

    skip_special_tokens = False

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._json = OpenAIJSONParser()

    def extract(self, text: str) -> ExtractedToolCalls:
        """Harmony messages when the turn starts with a header, else the JSON parser's extraction."""
        return extract_harmony(text) if is_harmony(text) else self._json.extract(text)

    def stream(self) -> ToolCallStream:
        """Holds the turn back while it may still begin a harmony header, then streams as the chosen format does:
        a content message's body as it is generated, each call once its message ends."""
        return _DispatchStream(self)


class _HarmonyStream(AdvancingToolCallStream):
    def __init__(self) -> None:
        super().__init__(extract_harmony)
        self._scanner = _HarmonyScanner()

    def _advance(self) -> str:
        return self._scanner.advance(self.text, final=False)


class _DispatchStream(ToolCallStream):
    def __init__(self, parser: OpenAIParser) -> None:
        super().__init__(parser.extract)
        self._json = parser._json
        self._inner: ToolCallStream | None = None

    def _release(self, delta: str) -> str:
        if self._inner is None:
            head = self.text.lstrip()
            if not head or any(len(head) < len(start) and start.startswith(head) for start in HARMONY_STARTS):
                return ""  # may still be a harmony header
            self._inner = _HarmonyStream() if is_harmony(head) else self._json.stream()
            delta = self.text
        new = self._inner.feed(delta)
        self._record(new)
        return new
