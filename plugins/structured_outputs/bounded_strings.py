"""Length-bounded JSON strings in a form whose token masks xgrammar computes ahead of time.

xgrammar's JSON-schema converter writes a string with ``minLength``/``maxLength`` as ``"\\"" chars{m, n} "\\""``.
Inside that repetition most tokens' fate depends on how many characters are left, so xgrammar checks them one by
one at every step: on a random model's JSON, 16 µs per request and step with a 4,096-token vocabulary and 125 µs
with 32,000 tokens (bench_structured_outputs.py's schema), most of a structured step's CPU cost.

:func:`chain_bounded_strings` writes the same language as ``m`` copies of ``chars`` then a chain of rules,
``upto_k ::= ("" | chars upto_{k-1}) (="\\"")``, one per number of optional characters left. Each rule stands for
one count, so xgrammar's compile-time cache decides almost every token per rule, and the lookahead (a string's
characters are always followed by its closing quote) lets it reject at compile time a token that runs past the
bound: 2.1 µs and 5.4 µs per request and step on those vocabularies, compiled in about the same time. Bounds above
:data:`MAX_CHAIN` keep xgrammar's repetition (compile time grows with the bound either way).
"""

from __future__ import annotations

import re

#: The longest ``maxLength`` written as a chain (compile time grows linearly with it, as it does for xgrammar's own
#: repetition: ~1 s at 128 with a 32,000-token vocabulary).
MAX_CHAIN = 256

# A rule that is a single character class, as xgrammar prints string characters: ``name ::= (([...]))``.
_CHAR_CLASS_RULE = re.compile(r"^(\w+) ::= \(\(\[(?:[^\]\\]|\\.)*\]\)\)$", re.MULTILINE)
# A bounded repetition of a rule between a string's quotes: ``"\"" name{m, n} "\""``.
_BOUNDED_STRING = re.compile(r'"\\"" (\w+)\{(\d+), (\d+)\} "\\""')


def chain_bounded_strings(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed grammar for a JSON schema) with each length-bounded string's repetition written
    as a chain of rules (see the module docstring); the language is unchanged."""
    char_rules = set(_CHAR_CLASS_RULE.findall(ebnf))
    rules: dict[str, str] = {}

    def chain(match: re.Match[str]) -> str:
        name, low, high = match.group(1), int(match.group(2)), int(match.group(3))
        if name not in char_rules or high > MAX_CHAIN or low > high:
            return match.group(0)
        parts = [name] * low
        if high > low:
            parts.append(_chain_rule(ebnf, rules, name, high - low))
        return '"\\"" ' + " ".join(parts) + ' "\\""' if parts else '"\\"" "\\""'

    rewritten = _BOUNDED_STRING.sub(chain, ebnf)
    if not rules:  # none, or only fixed lengths (written out in place)
        return rewritten
    return rewritten.rstrip("\n") + "\n" + "\n".join(rules.values()) + "\n"


def _chain_rule(ebnf: str, rules: dict[str, str], char_rule: str, optional: int) -> str:
    """The name of the rule taking 0 to ``optional`` characters of ``char_rule`` before a closing quote (adding it
    and the shorter ones it calls to ``rules``)."""
    prefix = f"{char_rule}_upto_"
    while re.search(rf"^{prefix}\d+ ::=", ebnf, re.MULTILINE):  # a name the converter already uses
        prefix = f"{prefix}x_"
    for k in range(1, optional + 1):
        name = f"{prefix}{k}"
        if name not in rules:
            body = char_rule if k == 1 else f"({char_rule} {prefix}{k - 1})"
            rules[name] = f'{name} ::= ("" | {body}) (="\\"")'
    return f"{prefix}{optional}"
