"""Tool-call parsers: name the tool a finished agent turn calls, from its text (``parse(text) -> str | None``).

- ``bash``: mini-swe-agent — exactly one ```` ```bash ```` block; the tool is its first word (``ls``, ``pytest``).
- ``openai``: JSON function calls — ``{"type": "function_call", "name": ...}``, ``{"name": ..., "arguments":
  ...}`` (Qwen, Llama-3.1 JSON with ``parameters``), ``{"tool_calls": [{"function": {"name": ...}}]}``, or a list.
- ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks.
- ``llama``: Llama pythonic calls ``func(arg=...)`` or ``[f(a=1), g(b=2)]``, optionally after ``<|python_tag|>``.
- ``auto``: hermes, openai, llama, then bash; the first that finds a call wins.

Several calls of one tool name that tool; calls of different tools give ``"multi_tool"``. No call gives None.
The Continuum scheduler only parses when the client did not send ``this_func_call`` (which always wins).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

MULTI_TOOL = "multi_tool"
MAX_TEXT_CHARS = 200_000  # longer texts are not parsed (a turn that long is not a tool call worth timing)

_BASH_BLOCK = re.compile(r"```bash\s*\n(.*?)\n```", re.DOTALL)
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def _combine(names: list[str]) -> str | None:
    distinct = list(dict.fromkeys(n for n in names if n))
    if not distinct:
        return None
    return distinct[0] if len(distinct) == 1 else MULTI_TOOL


def _call_names(obj: Any) -> list[str]:
    """Tool names in a decoded JSON value of any of the OpenAI-style shapes."""
    if isinstance(obj, list):
        return [name for item in obj for name in _call_names(item)]
    if not isinstance(obj, dict):
        return []
    if isinstance(obj.get("tool_calls"), list):
        return _call_names(obj["tool_calls"])
    function = obj.get("function")
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return [function["name"]]
    name = obj.get("name")
    if isinstance(name, str) and (
        obj.get("type") in ("function_call", "function") or "arguments" in obj or "parameters" in obj
    ):
        return [name]
    return []


class BashParser:
    """mini-swe-agent's convention (the released fork's only parser): exactly one bash block → its first word."""

    def parse(self, text: str) -> str | None:
        blocks = _BASH_BLOCK.findall(text)
        if len(blocks) != 1:
            return None
        words = blocks[0].split()
        return words[0] if words else None


class OpenAIJSONParser:
    """OpenAI-style JSON function calls, as the whole text or the first JSON value in it that is a call."""

    def parse(self, text: str) -> str | None:
        stripped = text.strip()
        try:
            return _combine(_call_names(json.loads(stripped)))
        except ValueError:
            pass
        decoder = json.JSONDecoder()
        for match in re.finditer(r"[\[{]", stripped):
            try:
                value, _ = decoder.raw_decode(stripped, match.start())
            except ValueError:
                continue
            names = _call_names(value)
            if names:
                return _combine(names)
        return None


class HermesParser:
    """Hermes / Qwen ``<tool_call>{json}</tool_call>`` blocks (malformed blocks are skipped)."""

    def parse(self, text: str) -> str | None:
        names: list[str] = []
        for body in _HERMES_BLOCK.findall(text):
            try:
                names.extend(_call_names(json.loads(body)))
            except ValueError:
                continue
        return _combine(names)


class LlamaPythonicParser:
    """Llama 3.2+ pythonic calls: the text (after an optional ``<|python_tag|>``) is ``f(a=1)`` or a list of such
    calls, keyword arguments only."""

    def parse(self, text: str) -> str | None:
        body = text.split(_PYTHON_TAG, 1)[-1].strip()
        if not body or (body[0] not in "[" and not body[0].isidentifier()):
            return None
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return None
        calls = tree.elts if isinstance(tree, ast.List) else [tree]
        names: list[str] = []
        for call in calls:
            if not isinstance(call, ast.Call) or call.args:
                return None
            if not isinstance(call.func, (ast.Name, ast.Attribute)):
                return None
            names.append(ast.unparse(call.func))
        return _combine(names)


class AutoParser:
    """Tries hermes, openai, llama and bash in turn; the first call found wins."""

    def __init__(self) -> None:
        self.parsers = (HermesParser(), OpenAIJSONParser(), LlamaPythonicParser(), BashParser())

    def parse(self, text: str) -> str | None:
        if not text or len(text) > MAX_TEXT_CHARS:
            return None
        for parser in self.parsers:
            name = parser.parse(text)
            if name is not None:
                return name
        return None


PARSERS: dict[str, type] = {
    "auto": AutoParser,
    "bash": BashParser,
    "openai": OpenAIJSONParser,
    "hermes": HermesParser,
    "llama": LlamaPythonicParser,
}
