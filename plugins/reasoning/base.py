"""The reasoning-parser interface: split a reply into its reasoning section and its content, whole or streamed.

A parser's ``extract_reasoning(text)`` gives ``(reasoning, content)``: the reasoning with its surrounding whitespace
stripped, the content as written (None for either when empty). ``stream()`` gives a :class:`ReasoningStream`, fed
each text delta of one reply. Streaming promise, for every split of a reply into deltas: the reasoning deltas
``feed`` returned, then ``finish()``'s, make exactly ``extract_reasoning(reply)[0] or ""``, and likewise the
content. So ``feed`` only returns text whose side is settled however the reply goes on: it holds back a marker
that may be starting, and whitespace it may have to strip.

Per request the server builds the parser as ``cls(thinking=..., prompt_open=...)``: ``thinking`` is whether the
request wants a reasoning section (``chat_template_kwargs`` ``enable_thinking`` / ``thinking``, else the parser's
``thinking_by_default``), ``prompt_open`` whether the rendered prompt already opened the section (a template that
ends the generation prompt with ``<think>``, as DeepSeek-R1's does), so the reply starts inside it.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from vllite.exceptions import InternalStateError

logger = logging.getLogger(__name__)

Split = tuple[str | None, str | None]


class ReasoningParser(abc.ABC):
    """Splits one reply into reasoning and content; see the module docstring for the promise.

    Class attributes the server reads: ``start_marker`` / ``end_marker`` (the text that opens and closes the
    section: the thinking budget forces ``end_marker``, and a constrained reply's grammar starts after it),
    ``thinking_by_default`` (whether a request that says nothing wants reasoning) and ``skip_special_tokens``
    (``False``: the markers are special tokens, so replies are detokenized with them).
    """

    start_marker: ClassVar[str] = ""
    end_marker: ClassVar[str] = ""
    thinking_by_default: ClassVar[bool] = True
    skip_special_tokens: ClassVar[bool | None] = None

    def __init__(self, *, thinking: bool | None = None, prompt_open: bool = False) -> None:
        self.thinking = self.thinking_by_default if thinking is None else thinking
        self.prompt_open = prompt_open

    @classmethod
    def thinking_requested(cls, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether a request wants a reasoning section: its ``enable_thinking`` or ``thinking`` template argument
        (the first given), else ``thinking_by_default``."""
        kwargs = chat_template_kwargs or {}
        for key in ("enable_thinking", "thinking"):
            if kwargs.get(key) is not None:
                return bool(kwargs[key])
        return cls.thinking_by_default

    @classmethod
    def prompt_opens_section(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending in ``prompt_tail`` leaves the section open: its last ``start_marker`` comes after
        its last ``end_marker``."""
        if not cls.start_marker:
            return False
        start = prompt_tail.rfind(cls.start_marker)
        return start >= 0 and (not cls.end_marker or start > prompt_tail.rfind(cls.end_marker))

    @abc.abstractmethod
    def extract_reasoning(self, text: str) -> Split:
        """``(reasoning, content)`` of a whole reply; never raises."""

    @abc.abstractmethod
    def stream(self) -> ReasoningStream:
        """A fresh streaming splitter for one reply."""


class ReasoningStream(abc.ABC):
    """A per-reply streaming splitter: ``feed`` each delta, then ``finish`` at the end (see the module docstring).

    Subclasses implement ``_release``; the base keeps the text and what was sent, and makes ``finish`` send exactly
    the rest of the whole-text split.
    """

    def __init__(self, extract: Callable[[str], Split]) -> None:
        self._extract = extract
        self.text = ""
        self.sent_reasoning = ""
        self.sent_content = ""
        self._result: tuple[str, str] | None = None

    def feed(self, delta: str) -> tuple[str, str]:
        """Adds ``delta``; returns ``(reasoning, content)`` now safe to send (often empty strings)."""
        if self._result is not None:
            raise InternalStateError("ReasoningStream.feed after finish")
        if not delta:
            return "", ""
        self.text = grow(self, "text", delta)
        reasoning, content = self._release()
        if reasoning:
            self.sent_reasoning = grow(self, "sent_reasoning", reasoning)
        if content:
            self.sent_content = grow(self, "sent_content", content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Ends the reply: ``(reasoning, content)`` not sent yet. Calling it again returns the same result."""
        if self._result is None:
            reasoning, content = self._extract(self.text)
            self._result = (
                _rest(reasoning or "", self.sent_reasoning, "reasoning"),
                _rest(content or "", self.sent_content, "content"),
            )
        return self._result

    @abc.abstractmethod
    def _release(self) -> tuple[str, str]:
        """The reasoning and content that became settled now that ``text`` grew."""


def _rest(whole: str, sent: str, side: str) -> str:
    if not whole.startswith(sent):  # a bug in a stream's rules: never resend, never raise
        logger.error("ReasoningStream sent %s text that is not the reply's %s; dropping the rest", side, side)
        return ""
    return whole[len(sent) :]


def grow(owner: object, attr: str, delta: str) -> str:
    """``getattr(owner, attr) + delta``, appending in place where CPython can (the attribute is cleared first, so the
    local is the only reference): a long stream of small deltas stays linear. The caller stores the result back."""
    text: str = getattr(owner, attr)
    setattr(owner, attr, "")
    text += delta
    return text
