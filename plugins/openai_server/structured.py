"""Structured outputs over HTTP: vLLM's ``structured_outputs`` extra field, OpenAI's ``response_format`` and forced
tool calls, each turned into one :class:`~vllite.structured_output.params.StructuredOutputsParams`.

- ``structured_outputs``: vLLM's field, a dict of ``StructuredOutputsParams`` fields (``{"json": {...}}``,
  ``{"regex": "..."}``, ``{"choice": [...]}``, ``{"grammar": "..."}``, ...), on both routes.
- ``response_format``: ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": true}}`` (the schema; always enforced, ``strict`` or not).
- ``tool_choice: "required"``: a JSON list of calls ``[{"name": ..., "parameters": {...}}]``, each one of the tools
  with arguments that validate against its schema; a named function: the reply is its arguments, validated against
  that function's schema.

Only one source may constrain a request; a second is a 400 naming both. The constraint itself (a bad schema, regex or
grammar, a feature no backend supports) is checked with the engine's structured-output config before submitting, so
that its 400 names the field it came from (``param``: ``structured_outputs``, ``response_format`` or ``tools``).
"""

from __future__ import annotations

from typing import Any

from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.protocol import ChatCompletionRequest, NamedToolChoice, SamplingFields
from vllite.structured_output.params import StructuredOutputsConfig, StructuredOutputsParams

#: A tool without ``parameters`` takes any JSON object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def check_constraint(
    constraint: StructuredOutputsParams | None, param: str, config: StructuredOutputsConfig | None
) -> StructuredOutputsParams | None:
    """``constraint`` once the backends accept it under ``config`` (the engine's); else a 400 whose ``param`` is the
    request field that gave it. The engine's frontend checks it again at submit, from the backends' cache."""
    if constraint is None or config is None:
        return constraint
    from vllite.structured_output.registry import validate_structured_outputs

    try:
        validate_structured_outputs(constraint, config)
    except ValueError as exc:
        raise BadRequestError(str(exc), param=param) from None
    return constraint


def structured_outputs_field(
    request: SamplingFields, config: StructuredOutputsConfig | None = None
) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs`` extra field as ``StructuredOutputsParams`` (400 naming the field when bad;
    with the engine's ``config``, also when no backend accepts the constraint)."""
    value = request.structured_outputs
    if value is None:
        return None
    fields = set(StructuredOutputsParams.__struct_fields__)
    unknown = sorted(set(value) - fields)
    if unknown:
        raise BadRequestError(
            f"structured_outputs has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}.",
            param="structured_outputs",
        )
    try:
        constraint = StructuredOutputsParams(**value)
    except (ValueError, TypeError) as exc:
        raise BadRequestError(str(exc), param="structured_outputs") from None
    return check_constraint(constraint, "structured_outputs", config)


def response_format_constraint(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """``response_format`` as a constraint (``None`` for ``text`` or no format)."""
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = fmt.json_schema
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise BadRequestError(
            'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}} with the schema as a '
            "JSON object.",
            param="response_format",
        )
    return StructuredOutputsParams(json=schema)


def tool_choice_constraint(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The constraint a forced tool call puts on the reply (``None`` for ``none``/``auto`` or no tools)."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        return None
    if isinstance(choice, NamedToolChoice):
        for tool in tools:
            if tool.function.name == choice.function.name:
                return StructuredOutputsParams(json=tool.function.parameters or _ANY_OBJECT)
        return None  # resolve_tool_mode names the unknown function
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or _ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array_schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not request.parallel_tool_calls:
        array_schema["maxItems"] = 1
    return StructuredOutputsParams(json=array_schema)


def chat_constraint(
    request: ChatCompletionRequest, config: StructuredOutputsConfig | None = None
) -> StructuredOutputsParams | None:
    """The chat request's one constraint, from ``structured_outputs``, ``response_format`` or a forced tool call;
    400 naming both when two of them constrain the reply. With the engine's ``config``, a constraint no backend
    accepts is a 400 naming its field (a tool's schema: ``tools``)."""
    sources = [
        ("structured_outputs", structured_outputs_field(request)),
        ("response_format", response_format_constraint(request)),
        ("tool_choice", tool_choice_constraint(request)),
    ]
    given = [(name, value) for name, value in sources if value is not None]
    if len(given) > 1:
        raise BadRequestError(
            f"{given[0][0]} and {given[1][0]} both constrain the reply; give only one.", param=given[1][0]
        )
    if not given:
        return None
    name, constraint = given[0]
    return check_constraint(constraint, "tools" if name == "tool_choice" else name, config)
