"""``MarkerReasoningParser``: the reasoning section is the text between a start marker and an end marker.

The rules, for a reply (``start_markers`` / ``end_markers`` are alternatives; where two match at one place, the
longer wins):

1. The section opens at a start marker that begins the reply (leading whitespace aside). Without one, it opens at
   the reply's start when the prompt left it open (``prompt_open``) or when the family may omit the marker
   (``implicit_start``, DeepSeek-R1) and the request wants reasoning; otherwise the whole reply is content, as written.
2. It closes at the first end marker after it; with none, the reply stopped while reasoning and is all reasoning.
3. The reasoning is stripped of surrounding whitespace; the content after the section loses its leading whitespace
   and then any ``content_prefixes`` framing it starts with (gpt-oss's final-channel header).

One scanner implements the rules for the whole text and for a stream: it decides a piece only once no continuation
can change it (``final`` says the text is complete), so the stream agrees with the whole-text split by construction.
"""

from __future__ import annotations

from typing import ClassVar

from vllite.plugins.reasoning.base import ReasoningParser, ReasoningStream, Split


def earliest_partial(text: str, markers: tuple[str, ...], start: int) -> int | None:
    """The first index ``>= start`` from which the rest of ``text`` is a proper prefix of a marker (one that may be
    completed by more text), or None."""
    longest = max(len(marker) for marker in markers)
    for i in range(max(start, len(text) - longest + 1), len(text)):
        tail = text[i:]
        if any(len(tail) < len(marker) and marker.startswith(tail) for marker in markers):
            return i
    return None


def find_marker(text: str, markers: tuple[str, ...], start: int, final: bool) -> tuple[int, str | None]:
    """``(index, marker)`` of the earliest marker at or after ``start`` (the longest where several start there), once
    certain; else ``(safe, None)``: no marker can begin before ``safe`` (the rest is held while one may be coming)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker, start)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1]))):
            best = (at, marker)
    held = None if final else earliest_partial(text, markers, start)
    if best is not None and (held is None or held > best[0]):
        return best
    if best is not None:
        assert held is not None
        return held, None
    return (len(text) if held is None else held), None


class MarkerReasoningParser(ReasoningParser):
    """A reasoning section between markers (see the module docstring for the rules)."""

    start_markers: ClassVar[tuple[str, ...]] = ("<think>",)
    end_markers: ClassVar[tuple[str, ...]] = ("</think>",)
    implicit_start: ClassVar[bool] = False
    content_prefixes: ClassVar[tuple[str, ...]] = ()
    start_marker = "<think>"
    end_marker = "</think>"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.start_marker, cls.end_marker = cls.start_markers[0], cls.end_markers[0]

    def opens_implicitly(self) -> bool:
        """Whether a reply without a leading start marker is inside the section from its start."""
        return self.prompt_open or (self.thinking and self.implicit_start)

    def extract_reasoning(self, text: str) -> Split:
        """``(reasoning, content)`` by the rules of the module docstring."""
        scanner = _Scanner(self)
        reasoning, content = scanner.advance(text, final=True)
        return (reasoning.strip() or None) if scanner.had_section else None, content or None

    def stream(self) -> ReasoningStream:
        """Streams each side as it settles: reasoning up to a possible end marker, content as it comes."""
        return _MarkerStream(self)


class _Scanner:
    """The rules over a growing text: ``advance`` returns the reasoning (unstripped) and content newly settled."""

    def __init__(self, parser: MarkerReasoningParser) -> None:
        self.parser = parser
        self.phase = "start"  # start | reasoning | content
        self.pos = 0  # the text before this is settled
        self.had_section = False
        self.after_section = False  # the content follows a section: its leading whitespace is dropped
        self.content_started = False

    def advance(self, text: str, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self.phase == "start":
            self._start(text, final)
        if self.phase == "reasoning":
            reasoning = self._reasoning(text, final)
        if self.phase == "content":
            content = self._content(text, final)
        return reasoning, content

    def _start(self, text: str, final: bool) -> None:
        lead = len(text) - len(text.lstrip())
        rest = text[lead:]
        starts = self.parser.start_markers
        if not final and (not rest or any(len(rest) < len(m) and m.startswith(rest) for m in starts)):
            return  # the reply may still open with a start marker
        matched = max((m for m in starts if rest.startswith(m)), key=len, default=None)
        if matched is not None:
            self._open(lead + len(matched))
        elif self.parser.opens_implicitly():
            self._open(0)
        else:
            self.phase = "content"

    def _open(self, pos: int) -> None:
        self.phase, self.pos, self.had_section = "reasoning", pos, True

    def _reasoning(self, text: str, final: bool) -> str:
        at, marker = find_marker(text, self.parser.end_markers, self.pos, final)
        piece = text[self.pos : at]
        if marker is None:
            self.pos = at
        else:
            self.phase, self.pos, self.after_section = "content", at + len(marker), True
        return piece

    def _content(self, text: str, final: bool) -> str:
        if not self.content_started:
            if self.after_section:
                self.pos = len(text) - len(text[self.pos :].lstrip())
                if self.pos == len(text) and not final:
                    return ""
            rest = text[self.pos :]
            prefixes = self.parser.content_prefixes
            if not final and any(len(rest) < len(p) and p.startswith(rest) for p in prefixes):
                return ""
            matched = max((p for p in prefixes if rest.startswith(p)), key=len, default="")
            self.pos += len(matched)
            self.content_started = True
        piece, self.pos = text[self.pos :], len(text)
        return piece


class _MarkerStream(ReasoningStream):
    """Feeds the scanner; strips the reasoning's ends by holding its leading and trailing whitespace back."""

    def __init__(self, parser: MarkerReasoningParser) -> None:
        super().__init__(parser.extract_reasoning)
        self._scanner = _Scanner(parser)
        self._held_ws = ""  # reasoning whitespace sent once more reasoning follows it

    def _release(self) -> tuple[str, str]:
        reasoning, content = self._scanner.advance(self.text, final=False)
        if reasoning:
            pending = self._held_ws + reasoning
            if not self.sent_reasoning:
                pending = pending.lstrip()
            body = pending.rstrip()
            self._held_ws = pending[len(body) :]
            reasoning = body
        return reasoning, content
