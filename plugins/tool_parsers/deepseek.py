# ruff: noqa: RUF001, RUF002  (DeepSeek's markers are written with fullwidth bars)
"""Tool-call parser for DeepSeek-V3 / R1 (``deepseek_v3``) and DeepSeek-V3.1 (``deepseek_v31``), vLLM's names.

The calls follow the text as one section::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(V3.1 writes ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``; both forms are read by both names.)
The content is the text before ``<｜tool▁calls▁begin｜>`` and any after ``<｜tool▁calls▁end｜>``. All or nothing: a
section that is not a sequence of well-formed calls leaves the whole turn as content.
"""

from __future__ import annotations

from vllite.plugins.tool_parsers.base import MarkerStream, ToolParserBase
from vllite.plugins.tool_parsers.extraction import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    arguments_json,
    extracted,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_FENCE_OPEN, _FENCE_CLOSE = "```json", "```"


class DeepSeekV3Parser(ToolParserBase):
    """DeepSeek's ``<｜tool▁calls▁begin｜>`` section of ``<｜tool▁call▁begin｜>…<｜tool▁call▁end｜>`` calls."""

    skip_special_tokens = False

    def extract(self, text: str) -> ExtractedToolCalls:
        """The section's calls, the text around the section as content; no call when the section is malformed."""
        at = text.find(CALLS_BEGIN)
        if at < 0:
            return extracted(text, [])
        section = _section_calls(text, at + len(CALLS_BEGIN))
        if section is None:
            return extracted(text, [])
        calls, end = section
        return extracted(text[:at] + text[end:], calls)

    def stream(self) -> ToolCallStream:
        """Sends the text before the section (holding back a partial marker), then holds the rest to the end."""
        return MarkerStream(self, CALLS_BEGIN)


def _section_calls(text: str, pos: int) -> tuple[list[ToolCall], int] | None:
    """The calls from ``pos`` (just after the section's opener) and where the section ends (after its closer, or
    the end of the turn when the model stopped there); None when it is malformed or holds no call."""
    calls: list[ToolCall] = []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith(CALLS_END, pos):
            return (calls, pos + len(CALLS_END)) if calls else None
        if pos == len(text):
            return (calls, pos) if calls else None
        if not text.startswith(CALL_BEGIN, pos):
            return None
        end = text.find(CALL_END, pos + len(CALL_BEGIN))
        if end < 0:
            return None
        call = _call(text[pos + len(CALL_BEGIN) : end])
        if call is None:
            return None
        calls.append(call)
        pos = end + len(CALL_END)


def _call(body: str) -> ToolCall | None:
    """``function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```'' (V3) or ``NAME<｜tool▁sep｜>ARGS`` (V3.1)."""
    head, sep, tail = body.partition(SEP)
    if not sep:
        return None
    name, newline, rest = tail.partition("\n")
    rest = rest.strip()
    if newline and rest.startswith(_FENCE_OPEN) and rest.endswith(_FENCE_CLOSE) and len(rest) >= 10:
        name, arguments = name.strip(), rest[len(_FENCE_OPEN) : -len(_FENCE_CLOSE)]
    else:
        name, arguments = head.strip(), tail
    text = arguments_json(arguments) if arguments.strip() else None
    return ToolCall(name, text) if name and text is not None and name.isprintable() else None
