"""Tool-call parser for Qwen3-Coder's XML calls (vLLM's ``qwen3_coder`` and ``qwen3_xml``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

One function per ``<tool_call>`` block; each parameter's value is its text (one newline after the opening tag and
one before the closing tag are not part of it). Values are converted by the tool's JSON schema when the server
passes the request's tools (``accepts_tools``), as vLLM does: ``string`` stays text, ``integer`` / ``number`` /
``boolean`` / ``object`` / ``array`` are read as such, ``null`` is null; a parameter the schema does not know stays
text. A block that is not exactly one well-formed function stays in the content, as hermes does.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from vllite.plugins.tool_parsers.base import BlockStream, ToolParserBase, extract_blocks
from vllite.plugins.tool_parsers.extraction import ExtractedToolCalls, ToolCall, ToolCallStream, dumps_object

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})


class Qwen3CoderParser(ToolParserBase):
    """Qwen3-Coder ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`` blocks."""

    accepts_tools = True

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls of the well-formed blocks and the text outside them."""
        return extract_blocks(text, OPEN, CLOSE, self._block_calls)

    def stream(self) -> ToolCallStream:
        """Sends text outside blocks as it comes, holding back each block until its ``</tool_call>``."""
        return BlockStream(self.extract, OPEN, CLOSE, self._block_calls)

    def _block_calls(self, body: str) -> list[ToolCall]:
        function = _FUNCTION.fullmatch(body)
        if function is None:
            return []
        name = function.group(1).strip()
        schema = self._properties(name)
        arguments: dict[str, Any] = {}
        pos = 0
        inner = function.group(2)
        for parameter in _PARAMETER.finditer(inner):
            key = parameter.group(1).strip()
            if inner[pos : parameter.start()].strip() or not key or key in arguments:
                return []
            arguments[key] = _convert(_value_text(parameter.group(2)), schema.get(key))
            pos = parameter.end()
        if inner[pos:].strip() or not name:
            return []
        text = dumps_object(arguments)
        return [ToolCall(name, text)] if text is not None else []

    def _properties(self, name: str) -> dict[str, Any]:
        """The ``properties`` of the request's tool ``name`` (empty when unknown)."""
        for tool in self.tools:
            function = tool.get("function", tool) if isinstance(tool, dict) else {}
            if isinstance(function, dict) and function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties")
                return properties if isinstance(properties, dict) else {}
        return {}


def _value_text(raw: str) -> str:
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def _schema_type(schema: Any) -> str | None:
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind.lower() if isinstance(kind, str) else None


def _convert(value: str, schema: Any) -> Any:
    """``value`` as its schema's type (vLLM's rules); the text itself when the schema is unknown or it fails."""
    kind = _schema_type(schema)
    if kind is None or kind in _STRING_TYPES:
        return value
    if value.strip().lower() == "null":
        return None
    stripped = value.strip()
    try:
        if kind in ("integer", "int"):
            return int(stripped)
        if kind in ("number", "float", "double"):
            number = float(stripped)
            return int(number) if number.is_integer() and "." not in stripped and "e" not in stripped else number
        if kind in ("boolean", "bool"):
            return stripped.lower() == "true" if stripped.lower() in ("true", "false") else value
    except ValueError:
        return value
    try:
        return json.loads(stripped)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(stripped)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
