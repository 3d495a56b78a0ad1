"""The ``xgrammar`` backend (the default): JSON schemas, regexes, choices, EBNF grammars and structural tags.

JSON goes through xgrammar's schema converter, then :func:`~.strict_json.strict_json_ebnf`
so strings never hold raw control characters, then
:func:`~.bounded_strings.chain_bounded_strings` so the token masks of length-bounded strings
are worked out at compile time, not token by token at every step. Schema keywords xgrammar ignores (its converter
warns and carries on) are refused at validation, so ``auto`` can hand such a schema to another backend instead of
producing output that does not validate.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any, ClassVar

from vllite.plugins.structured_outputs.bounded_strings import chain_bounded_strings
from vllite.plugins.structured_outputs.strict_json import strict_json_ebnf
from vllite.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar

if TYPE_CHECKING:
    import torch

    from vllite.structured_output.params import GrammarSpec

# Keywords xgrammar's converter ignores, per JSON type (vLLM refuses the same ones for xgrammar).
_UNSUPPORTED_KEYWORDS: dict[str, tuple[str, ...]] = {
    "number": ("multipleOf",),
    "integer": ("multipleOf",),
    "array": ("uniqueItems", "contains", "minContains", "maxContains"),
    "object": ("patternProperties", "propertyNames", "minProperties", "maxProperties"),
}


def unsupported_json_keywords(schema: Any, path: str = "$") -> list[str]:
    """``path: keyword`` for each keyword in ``schema`` (recursively) that xgrammar would silently ignore."""
    found: list[str] = []
    if isinstance(schema, dict):
        kind = schema.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        for k in kinds:
            for keyword in _UNSUPPORTED_KEYWORDS.get(k, ()) if isinstance(k, str) else ():
                if keyword in schema:
                    found.append(f"{path}: {keyword}")
        for key, value in schema.items():
            found.extend(unsupported_json_keywords(value, f"{path}.{key}"))
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            found.extend(unsupported_json_keywords(value, f"{path}[{i}]"))
    return found


def _load_schema(spec: GrammarSpec) -> Any:
    if spec.kind == "json_object":
        return {"type": "object"}
    try:
        return json.loads(spec.text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs.json is not valid JSON: {exc}.") from None


def _choice_ebnf(text: str) -> str:
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(choice) for choice in json.loads(text))


def _structural_tag(text: str) -> tuple[list[Any], list[str]]:
    import xgrammar as xgr

    try:
        value = json.loads(text)
        structures = value["structures"]
        triggers = value["triggers"]
        tags = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]) for s in structures
        ]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(
            "structured_outputs.structural_tag must be JSON like "
            '{"structures": [{"begin": ..., "schema": {...}, "end": ...}], "triggers": [...]}: '
            f"{type(exc).__name__}: {exc}."
        ) from None
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structured_outputs.structural_tag.triggers must be a list of non-empty strings.")
    return tags, triggers


def _ebnf_for(spec: GrammarSpec) -> str:
    """The EBNF xgrammar compiles for ``spec`` (not for structural tags); ``ValueError`` naming the problem."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = _load_schema(spec)
            unsupported = unsupported_json_keywords(schema)
            if unsupported:
                raise ValueError(
                    "structured_outputs.json uses JSON-schema keywords the xgrammar backend does not support: "
                    + ", ".join(unsupported)
                    + ' (use structured_outputs_config {"backend": "guidance"} or "auto").'
                )
            if not spec.additional_properties and isinstance(schema, dict):
                schema = _no_additional_properties(schema)
            grammar = xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=spec.any_whitespace, strict_mode=not spec.additional_properties
            )
            return chain_bounded_strings(strict_json_ebnf(str(grammar)))
        if kind == "regex":
            return str(xgr.Grammar.from_regex(spec.text))
        if kind == "choice":
            return str(xgr.Grammar.from_ebnf(_choice_ebnf(spec.text)))
        if kind == "grammar":
            return str(xgr.Grammar.from_ebnf(spec.text))
    except ValueError:
        raise
    except Exception as exc:  # xgrammar reports parse errors as RuntimeError
        raise ValueError(f"structured_outputs.{kind} is invalid for the xgrammar backend: {_clean(exc)}") from None
    raise ValueError(f"The xgrammar backend does not support structured_outputs.{kind}.")


def _no_additional_properties(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not say otherwise."""
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _clean(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file:line:`` prefix."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip())


class XgrammarGrammar(StructuredOutputGrammar):
    """An xgrammar ``GrammarMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Accepts the tokens one by one; False at the first refused one."""
        if len(token_ids) == 1:  # every step of every constrained request without drafts
            return self.matcher.accept_token(token_ids[0])
        return all(self.matcher.accept_token(token_id) for token_id in token_ids)

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The allowed prefix (tokens accepted, then rolled back)."""
        accepted = 0
        for token_id in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return token_ids[:accepted]

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Writes the allowed tokens into row ``index``."""
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        """Whether the matcher accepted its stop token."""
        return bool(self.matcher.is_terminated())

    def reset(self) -> None:
        """Back to the start state."""
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    """Compiles with an ``xgrammar.GrammarCompiler`` over the tokenizer's vocabulary (its own cache off: the
    manager caches compiled grammars)."""

    supported_kinds: ClassVar[frozenset[str]] = frozenset(
        {"json", "json_object", "regex", "choice", "grammar", "structural_tag"}
    )

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.eos_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._batch: Any = None  # a BatchGrammarMatcher, made at the first batched fill
        self._batch_threads = max(1, min(8, (os.cpu_count() or 2) // 2))

    @classmethod
    def validate(cls, spec: GrammarSpec) -> None:
        """Converts ``spec`` (no tokenizer needed); ``ValueError`` naming the problem."""
        if spec.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                '(use structured_outputs_config {"backend": "guidance"} or "auto").'
            )
        if spec.kind == "structural_tag":
            import xgrammar as xgr

            tags, triggers = _structural_tag(spec.text)
            try:
                xgr.Grammar.from_structural_tag(tags, triggers)
            except Exception as exc:
                raise ValueError(f"structured_outputs.structural_tag is invalid: {_clean(exc)}") from None
            return
        _ebnf_for(spec)

    def compile(self, spec: GrammarSpec) -> Any:
        """A ``CompiledGrammar``."""
        if spec.kind == "structural_tag":
            tags, triggers = _structural_tag(spec.text)
            return self.compiler.compile_structural_tag(tags, triggers)
        return self.compiler.compile_grammar(_ebnf_for(spec))

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A ``GrammarMatcher`` over ``compiled``."""
        import xgrammar as xgr

        return XgrammarGrammar(xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """One ``BatchGrammarMatcher`` call for the whole batch (C++ threads, no per-request Python call), where it
        has more than one thread; with one, a call per matcher is faster (0.37 against 0.50 ms for 256)."""
        if self._batch_threads == 1:
            super().fill_bitmasks(grammars, bitmask, rows)
            return
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(self._batch_threads)
        matchers = [grammar.matcher for grammar in grammars]  # type: ignore[attr-defined]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
