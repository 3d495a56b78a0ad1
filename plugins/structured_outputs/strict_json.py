"""Strict JSON from xgrammar: JSON strings hold neither raw control characters (RFC 8259 §7) nor UTF-16 surrogates.

xgrammar's JSON-schema converter writes the characters of a length-bounded string (``minLength``/``maxLength``) as
``[^"\\\\\\r\\n]``, which admits raw control characters U+0000-U+001F other than CR and LF: a random or weak model
then emits, say, a raw tab or U+0001 inside a string, and a strict parser (Python's ``json.loads``) rejects the
output. Every negated string class (bounded or not) also admits the surrogate range U+D800-U+DFFF, whose UTF-8
forms (``ED A0``-``ED BF`` ...) are not valid UTF-8: with a byte-level tokenizer a model emits them, the text decodes
to replacement characters and a ``maxLength`` is exceeded. :func:`strict_json_ebnf` rewrites those character
classes to exclude both ranges, so every string xgrammar allows is valid JSON in valid UTF-8.
"""

from __future__ import annotations

# The classes xgrammar prints for JSON string characters: bounded strings' (lax), unbounded strings' and the
# builtin JSON grammar's.
_STRING_CHAR_CLASSES = (
    '[^\\"\\\\\\r\\n]',
    '[^\\"\\\\\\n\\r]',
    '[^\\0-\\x1f\\"\\\\\\r\\n]',
    '[^\\"\\\\\\0-\\x1f]',
)
_STRICT_CHAR_CLASS = '[^\\"\\\\\\0-\\x1f\\uD800-\\uDFFF]'


def strict_json_ebnf(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed grammar for a JSON schema) with every string-character class narrowed to
    exclude control characters (U+0000-U+001F) and surrogates (U+D800-U+DFFF)."""
    for lax in _STRING_CHAR_CLASSES:
        ebnf = ebnf.replace(lax, _STRICT_CHAR_CLASS)
    return ebnf
