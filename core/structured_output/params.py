"""``StructuredOutputsParams`` (one request's constraint) and ``StructuredOutputsConfig`` (the engine's defaults).

Spelled as vLLM spells them::

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))
    SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\\d{3}-\\d{4}"))
    SamplingParams(structured_outputs=StructuredOutputsParams(choice=["positive", "negative"]))
    SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
    LLM(model, structured_outputs_config={"backend": "auto", "disable_any_whitespace": True})

A request carries exactly one constraint (``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` or
``structural_tag``); the whitespace options default to the engine's (``None`` = "the engine decides"). The shape is
checked when the struct is built (``ValueError`` naming the field); whether the constraint itself compiles (a valid
schema, regex or grammar, a feature the chosen backend supports) is checked by the frontend at submit time
(:func:`vllite.structured_output.registry.validate_structured_outputs`). Import-light: no torch, no backend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

#: The constraint fields, in the order they are reported.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: The backend names ``StructuredOutputsConfig.backend`` accepts besides registered ones.
AUTO = "auto"


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One request's output constraint (vLLM's ``StructuredOutputsParams``).

    ``json``: a JSON schema (a dict or its JSON text); ``regex``: a regular expression the whole output matches;
    ``choice``: the output is one of these strings; ``grammar``: an EBNF (GBNF) grammar (``root ::= ...``; the
    ``guidance`` backend also reads Lark); ``json_object``: any JSON object; ``structural_tag``: xgrammar's
    structural tag as JSON text (``{"structures": [...], "triggers": [...]}``). Options: ``disable_any_whitespace``
    (JSON without free whitespace), ``disable_additional_properties`` (objects only have the schema's properties),
    ``whitespace_pattern`` (a regex for JSON whitespace, ``guidance`` only). ``backend`` is the backend the
    frontend resolved for this request (set at submit; a user may set it to pin one).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        given = [name for name in CONSTRAINT_FIELDS if self._is_set(name)]
        if not given:
            raise ValueError(
                "StructuredOutputsParams needs exactly one constraint: one of " + ", ".join(CONSTRAINT_FIELDS) + "."
            )
        if len(given) > 1:
            raise ValueError(
                f"StructuredOutputsParams takes exactly one constraint, got {len(given)}: {', '.join(given)}."
            )
        self._check_types()

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        if name == "json_object":
            return bool(value)
        return value is not None

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"StructuredOutputsParams.json must be a JSON schema (dict or JSON text), got {self.json!r}."
            )
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern", "backend"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"StructuredOutputsParams.{name} must be a string, got {value!r}.")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"StructuredOutputsParams.{name} must not be empty.")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings.")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    f"StructuredOutputsParams.choice must hold non-empty strings only, got {self.choice!r}."
                )
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"StructuredOutputsParams.{name} must be True, False or None, got {value!r}.")

    @property
    def kind(self) -> str:
        """The constraint's field name (``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` or
        ``structural_tag``)."""
        return next(name for name in CONSTRAINT_FIELDS if self._is_set(name))

    def with_defaults(self, config: StructuredOutputsConfig) -> StructuredOutputsParams:
        """A copy whose unset options take the engine's defaults (``config``)."""
        return msgspec.structs.replace(
            self,
            disable_any_whitespace=(
                config.disable_any_whitespace if self.disable_any_whitespace is None else self.disable_any_whitespace
            ),
            disable_additional_properties=(
                config.disable_additional_properties
                if self.disable_additional_properties is None
                else self.disable_additional_properties
            ),
            whitespace_pattern=self.whitespace_pattern or config.whitespace_pattern,
        )

    def spec(self) -> GrammarSpec:
        """The constraint as a :class:`GrammarSpec` (the compiled-grammar cache key, less the backend)."""
        kind = self.kind
        text: str
        if kind == "json":
            # Not key-sorted: the schema's property order is the output's.
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
        elif kind == "choice":
            text = json.dumps(self.choice)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return GrammarSpec(
            kind=kind,
            text=text,
            any_whitespace=not self.disable_any_whitespace,
            additional_properties=not self.disable_additional_properties,
            whitespace_pattern=self.whitespace_pattern,
        )


@dataclass(frozen=True)
class GrammarSpec:
    """What a backend compiles: the constraint's kind and text (a schema as JSON text, choices as a JSON list) and
    the JSON options. Hashable: with the backend's name, the key of the compiled-grammar cache."""

    kind: str
    text: str
    any_whitespace: bool = True
    additional_properties: bool = True
    whitespace_pattern: str | None = None


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """The engine's structured-output defaults (vLLM's ``--structured-outputs-config``).

    ``backend``: ``auto`` (``xgrammar``, falling back to ``guidance`` where xgrammar does not support the
    constraint), or a registered backend's name. ``disable_any_whitespace``, ``disable_additional_properties`` and
    ``whitespace_pattern``: defaults for requests that do not set them. ``compile_threads``: threads compiling
    grammars in the engine core. ``cache_size``: compiled grammars kept per backend (least recently used out).
    """

    backend: str = AUTO
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    compile_threads: int = 2
    cache_size: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"structured_outputs_config.backend must be a backend name, got {self.backend!r}.")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                value = getattr(self, name)
                raise ValueError(f"structured_outputs_config.{name} must be true or false, got {value!r}.")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError(
                f"structured_outputs_config.whitespace_pattern must be a string, got {self.whitespace_pattern!r}."
            )
        for name in ("compile_threads", "cache_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"structured_outputs_config.{name} must be a positive integer, got {value!r}.")

    @classmethod
    def resolve(cls, value: StructuredOutputsConfig | dict[str, Any] | str | None) -> StructuredOutputsConfig:
        """The config from a ``StructuredOutputsConfig``, a dict, its JSON text or ``None`` (defaults); unknown keys
        and bad values raise ``ValueError`` naming the field."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs_config is not valid JSON: {exc}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a JSON object, got {type(value).__name__}.")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs_config has unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}."
            )
        return cls(**value)
