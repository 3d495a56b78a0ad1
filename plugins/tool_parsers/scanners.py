"""Incremental scanners that tell a streaming tool-call extractor how far a possible call reaches.

Both read a growing text from a start index, resuming where they stopped, and ``advance(text)`` answers:
``None`` while the text read so far may still be the start of what they look for, the end index (exclusive)
once it is complete, or ``DEAD`` once it cannot be. ``DEAD`` is only ever answered when no continuation of the
text could change that.

- ``JSONPrefix``: a JSON array or object as Python's ``json`` reads it (``NaN``/``Infinity`` included). It checks
  the structure, not every detail (control characters in strings, escapes): a value it completes may still fail
  to decode, but a value ``json`` decodes is never ``DEAD`` and ends where ``json`` ends it. Past
  ``MAX_JSON_DEPTH`` nested containers it stops reading and answers None from then on (holding such text back
  is always safe, and it keeps a stream linear: each completed value would be rescanned for calls inside it).
- ``PythonicHead``: a Llama pythonic call's head: a dotted name then its ``(...)``, or a ``[...]`` list, skipping
  Python strings and comments. It is the definition of where such a call ends, used by the extractor as well.
"""

from __future__ import annotations

import re

DEAD = -1
MAX_JSON_DEPTH = 64

_JSON_WS = " \t\n\r"
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBER_PREFIX = re.compile(r"-?\d*(?:\.\d*)?(?:[eE][-+]?\d*)?")
_SCALAR_START = frozenset("-0123456789tfnNI")
_SCALAR_CHARS = frozenset("+-.0123456789eEtrufalsnNIiy")
_STRING_RUN = re.compile(r'[^"\\]*')
_WS_RUN = re.compile(r"[ \t\n\r]*")
_CLOSERS = {"{": "}", "[": "]"}


def _viable_scalar(token: str) -> bool:
    return bool(_NUMBER_PREFIX.fullmatch(token)) or any(literal.startswith(token) for literal in _LITERALS)


def _complete_scalar(token: str) -> bool:
    return token in _LITERALS or bool(_NUMBER.fullmatch(token))


class JSONPrefix:
    """Reads a JSON array or object starting at ``start`` (which holds ``{`` or ``[``) across calls."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._stack: list[str] = []
        self._expect = "value"  # value | key | colon | comma
        self._just_opened = False  # the innermost container is empty so far: its closer may come
        self._in_string = False
        self._escape = False
        self._token = ""  # the number or literal being read
        self._result: int | None = None
        self._gave_up = False

    def advance(self, text: str) -> int | None:
        """Reads ``text`` from where the last call stopped: None (may continue), the value's end, or ``DEAD``."""
        i, n = self._pos, len(text)
        while self._result is None and not self._gave_up and i < n:
            if self._in_string:
                i = self._read_string(text, i)
                continue
            c = text[i]
            if self._token:
                if c in _SCALAR_CHARS:
                    self._token += c
                    if not _viable_scalar(self._token):
                        self._result = DEAD
                    i += 1
                    continue
                if not _complete_scalar(self._token):
                    self._result = DEAD
                    break
                self._token, self._expect = "", "comma"
            if c in _JSON_WS:
                i = _WS_RUN.match(text, i).end()  # type: ignore[union-attr]  # matches the empty string
                continue
            self._step(c, i)
            i += 1
        self._pos = i
        return self._result

    def _read_string(self, text: str, i: int) -> int:
        if self._escape:
            self._escape = False
            return i + 1
        i = _STRING_RUN.match(text, i).end()  # type: ignore[union-attr]  # matches the empty string
        if i < len(text):
            if text[i] == "\\":
                self._escape = True
            else:
                self._in_string = False
                self._expect = "colon" if self._expect == "key" else "comma"
            i += 1
        return i

    def _step(self, c: str, i: int) -> None:
        expect, just_opened = self._expect, self._just_opened
        self._just_opened = False
        if c in "}]" and (expect == "comma" or (just_opened and expect in ("key", "value"))):
            if not self._stack or _CLOSERS[self._stack[-1]] != c:
                self._result = DEAD
                return
            self._stack.pop()
            self._expect = "comma"
            if not self._stack:
                self._result = i + 1
        elif expect == "value" and c in "{[":
            if len(self._stack) == MAX_JSON_DEPTH:
                self._gave_up = True
                return
            self._stack.append(c)
            self._expect, self._just_opened = ("key" if c == "{" else "value"), True
        elif expect in ("value", "key") and c == '"':
            self._in_string = True  # ``_expect`` stays: it says whether the string is a key
        elif expect == "value" and c in _SCALAR_START:
            self._token = c
        elif expect == "colon" and c == ":":
            self._expect = "value"
        elif expect == "comma" and c == "," and self._stack:
            self._expect = "key" if self._stack[-1] == "{" else "value"
        else:
            self._result = DEAD


class PythonicHead:
    """Reads a pythonic call's head starting at ``start`` (a non-space character) across calls: a dotted name
    (spaces allowed around its dots) followed by ``(``, or ``[``; then up to the matching closer, skipping
    brackets inside strings (``'``, ``"``, triple-quoted, backslash escapes) and ``#`` comments."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._phase = "start"  # start | name | after_name | dot | brackets
        self._stack: list[str] = []
        self._quote = ""  # the quote character of the string being read, or of the quotes being counted
        self._opening_quotes = 0  # quotes counted at a string's start (1 or 2; 3 opens a triple-quoted one)
        self._triple = False
        self._escape = False
        self._closing_quotes = 0  # consecutive quotes read inside a triple-quoted string
        self._comment = False
        self._result: int | None = None

    def advance(self, text: str) -> int | None:
        """Reads ``text`` from where the last call stopped: None (may continue), the head's end, or ``DEAD``."""
        i, n = self._pos, len(text)
        while self._result is None and i < n:
            if self._phase == "brackets":
                i = self._brackets(text[i], i)
            else:
                self._name(text[i], i)
                i += 1
        self._pos = i
        return self._result

    def _name(self, c: str, i: int) -> None:
        phase = self._phase
        if phase == "start" and c == "[":
            self._open(c)
        elif phase in ("start", "dot") and c.isidentifier():
            self._phase = "name"
        elif phase == "name" and ("a" + c).isidentifier():
            pass
        elif phase in ("name", "after_name") and c in ".(":
            if c == "(":
                self._open(c)
            else:
                self._phase = "dot"
        elif phase in ("name", "after_name", "dot") and c.isspace():
            if phase == "name":
                self._phase = "after_name"
        else:
            self._result = DEAD

    def _open(self, c: str) -> None:
        self._stack.append(c)
        self._phase = "brackets"

    def _brackets(self, c: str, i: int) -> int:
        """Reads ``c`` at ``i`` inside the brackets; returns the next index (``i`` again to reread ``c``)."""
        if self._comment:
            self._comment = c != "\n"
        elif self._opening_quotes:
            if c == self._quote and self._opening_quotes < 3:
                self._opening_quotes += 1
                if self._opening_quotes == 3:
                    self._opening_quotes, self._triple = 0, True
                return i + 1
            if self._opening_quotes == 1:
                self._opening_quotes, self._triple = 0, False  # a one-quote string starts with ``c``
            else:
                self._opening_quotes, self._quote = 0, ""  # ``''``: an empty string, then ``c``
            return i
        elif self._quote:
            self._string_char(c)
        elif c == "#":
            self._comment = True
        elif c in "'\"":
            self._quote, self._opening_quotes = c, 1
        elif c in "([{":
            self._stack.append(c)
        elif c in ")]}":
            if "([{"[")]}".index(c)] != self._stack.pop():
                self._result = DEAD
            elif not self._stack:
                self._result = i + 1
        return i + 1

    def _string_char(self, c: str) -> None:
        if self._escape:
            self._escape, self._closing_quotes = False, 0
        elif c == "\\":
            self._escape, self._closing_quotes = True, 0
        elif c != self._quote:
            self._closing_quotes = 0
        elif not self._triple:
            self._quote = ""
        else:
            self._closing_quotes += 1
            if self._closing_quotes == 3:
                self._quote, self._closing_quotes = "", 0
