"""Strict JSON from xgrammar: no raw control characters inside JSON strings (RFC 8259 §7).

xgrammar's JSON-schema converter writes the characters of a length-bounded string (``minLength``/``maxLength``) as
``[^"\\\\\\r\\n]``, which admits raw control characters U+0000-U+001F other than CR and LF. A random or weak model
then emits, say, a raw tab or U+0001 inside a string, and a strict parser (Python's ``json.loads``) rejects the
output. :func:`strict_json_ebnf` rewrites those character classes to exclude every control character, as the
unbounded string rule already does, so every string xgrammar allows is valid JSON.
"""

from __future__ import annotations

# The lax class xgrammar prints for a bounded string's characters, and the strict one (its unbounded strings').
_LAX_CHAR_CLASSES = ('[^\\"\\\\\\r\\n]', '[^\\"\\\\\\n\\r]')
_STRICT_CHAR_CLASS = '[^\\"\\\\\\0-\\x1f]'


def strict_json_ebnf(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed grammar for a JSON schema) with every string-character class that admits raw
    control characters narrowed to exclude U+0000-U+001F."""
    for lax in _LAX_CHAR_CLASSES:
        ebnf = ebnf.replace(lax, _STRICT_CHAR_CLASS)
    return ebnf
