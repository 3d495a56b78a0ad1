"""The ``guidance`` backend (llguidance): JSON schemas, regexes, choices and grammars (GBNF/EBNF or Lark).

llguidance writes JSON strings with escaped control characters only, so its JSON parses strictly as is. A
constraint is validated by llguidance itself (``LLMatcher.validate_grammar``), which names unimplemented schema
keywords, so ``auto`` falls back from xgrammar to here for those only when llguidance supports them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar

from vllite.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar

if TYPE_CHECKING:
    import torch

    from vllite.structured_output.params import GrammarSpec


def guidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar for ``spec`` (``ValueError`` naming the problem; not yet validated)."""
    import llguidance
    from llguidance import LLMatcher

    kind = spec.kind
    if kind in ("json", "json_object"):
        if kind == "json_object":
            schema: Any = {"type": "object"}
        else:
            try:
                schema = json.loads(spec.text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}.") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON object (a schema), got {type(schema).__name__}.")
        options: Any = {"whitespace_flexible": spec.any_whitespace}
        if spec.whitespace_pattern is not None:
            options["whitespace_pattern"] = spec.whitespace_pattern
        if isinstance(schema, dict) and not spec.additional_properties:
            schema = {**schema, "additionalProperties": schema.get("additionalProperties", False)}
        return str(LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options))
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(spec.text))
    if kind in ("choice", "grammar"):
        try:
            return str(llguidance.grammar_from("choice" if kind == "choice" else "grammar", spec.text))
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{kind} is invalid for the guidance backend: {exc}") from None
    raise ValueError(f"The guidance backend does not support structured_outputs.{kind}.")


def check_guidance_grammar(kind: str, grammar: str, tokenizer: Any = None) -> None:
    """``ValueError`` with llguidance's message when ``grammar`` is invalid (or uses unimplemented features)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"structured_outputs.{kind} is invalid for the guidance backend: {error}")


class GuidanceGrammar(StructuredOutputGrammar):
    """An llguidance ``LLMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Consumes the tokens; False when one is not allowed (the matcher is then in its error state)."""
        return all(self.matcher.consume_token(token_id) for token_id in token_ids)

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The allowed prefix (llguidance checks without consuming)."""
        return token_ids[: self.matcher.validate_tokens(token_ids)]

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Writes the allowed tokens into row ``index`` (llguidance writes through the row's pointer)."""
        row = bitmask[index]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def is_terminated(self) -> bool:
        """Whether the matcher stopped (its EOS was consumed, or nothing can follow)."""
        return bool(self.matcher.is_stopped())

    def reset(self) -> None:
        """Back to the start state."""
        self.matcher.reset()


class GuidanceBackend(StructuredOutputBackend):
    """Compiles with llguidance over an ``LLTokenizer`` built from the Hugging Face (fast) tokenizer."""

    supported_kinds: ClassVar[frozenset[str]] = frozenset({"json", "json_object", "regex", "choice", "grammar"})

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import llguidance.hf

        eos = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else (self.eos_token_ids or None)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    @classmethod
    def validate(cls, spec: GrammarSpec) -> None:
        """Builds and validates the llguidance grammar (no tokenizer needed)."""
        if spec.kind not in cls.supported_kinds:
            raise ValueError(
                f"The guidance backend does not support structured_outputs.{spec.kind} "
                '(use structured_outputs_config {"backend": "xgrammar"} or "auto").'
            )
        check_guidance_grammar(spec.kind, guidance_grammar(spec))

    def compile(self, spec: GrammarSpec) -> Any:
        """A started ``LLMatcher``, copied for each request (``deep_copy``)."""
        from llguidance import LLMatcher

        grammar = guidance_grammar(spec)
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            error = matcher.get_error()
            raise ValueError(f"structured_outputs.{spec.kind} is invalid for the guidance backend: {error}")
        return matcher

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A copy of the compiled matcher, in its start state."""
        return GuidanceGrammar(compiled.deep_copy())
