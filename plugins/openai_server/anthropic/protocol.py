"""Anthropic's Messages API shapes: the request (pydantic, validated) and the response, stream events and errors
(msgspec structs, encoded straight to JSON), as the official ``anthropic`` client reads them.

A request's unknown top-level field is refused (400), as Anthropic refuses it; content blocks and tools may carry
fields vllite does not use (``cache_control``, ``citations``), which are accepted and ignored. A few vLLM extras are
accepted too (``chat_template_kwargs``, ``vllm_xargs``, ``seed``, ...), for clients that send them in ``extra_body``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# ---------------------------------------------------------------- request


class _Block(BaseModel):
    """A content block: fields vllite does not use (``cache_control``, ``citations``) are ignored."""

    model_config = ConfigDict(extra="ignore")


class TextBlockParam(_Block):
    """``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str


class ToolUseBlockParam(_Block):
    """An assistant's tool call: ``{"type": "tool_use", "id", "name", "input": {...}}``."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class UnsupportedBlockParam(_Block):
    """A block kind Anthropic defines that vllite cannot serve (images, documents, server tools): refused with a
    400 that names it, rather than a schema error."""

    type: Literal["image", "document", "search_result", "server_tool_use", "web_search_tool_result"]


class ToolResultBlockParam(_Block):
    """A tool's result, in a user turn: ``{"type": "tool_result", "tool_use_id", "content", "is_error"}``."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlockParam | UnsupportedBlockParam, Field(discriminator="type")]] | None = None
    is_error: bool = False


class ThinkingBlockParam(_Block):
    """Reasoning of an earlier assistant turn: ``{"type": "thinking", "thinking", "signature"}``."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(_Block):
    """Encrypted reasoning (Claude's): accepted in the history and left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlockParam = Annotated[
    TextBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam
    | UnsupportedBlockParam,
    Field(discriminator="type"),
]


class MessageParam(BaseModel):
    """One turn of ``messages``: ``role`` user or assistant, ``content`` a text or a list of blocks."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(BaseModel):
    """A client tool: ``{"name", "description", "input_schema"}`` (``type`` ``custom`` or left out)."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoiceParam(BaseModel):
    """``tool_choice``: ``auto`` (the default with tools), ``any`` (some tool), ``tool`` (the one ``name``d) or
    ``none``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(BaseModel):
    """``thinking``: ``enabled`` (with ``budget_tokens``, the most tokens to think), ``adaptive`` or ``disabled``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class ConversationFields(BaseModel):
    """What both ``/v1/messages`` and ``/v1/messages/count_tokens`` render: the conversation, its tools, and the
    chat-template arguments."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    # vLLM's extra
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(ConversationFields):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None  # accepted, ignored: one tier here
    # vLLM's extras
    seed: int | None = None
    priority: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    vllm_xargs: dict[str, Any] | None = None


class CountTokensRequest(ConversationFields):
    """``POST /v1/messages/count_tokens``."""


# ---------------------------------------------------------------- response


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""  # vllite signs nothing; the field is there because the client's type has it


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(msgspec.Struct):
    """Token counts: ``input_tokens`` are the prompt tokens computed; ``cache_read_input_tokens`` the ones served from
    the prefix cache (their sum is the prompt)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Message(msgspec.Struct, tag_field="type", tag="message"):
    """The response of ``/v1/messages`` (and, empty, the ``message`` of the ``message_start`` event)."""

    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorBody(msgspec.Struct, tag_field="type", tag="error"):
    """Anthropic's error object: ``{"type": "error", "error": {"type", "message"}}``."""

    error: ErrorDetail


#: Anthropic's error type for each status vllite answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def error_body(status: int, message: str) -> ErrorBody:
    """The error object for ``status`` (``api_error`` for a status Anthropic names no type for)."""
    return ErrorBody(error=ErrorDetail(type=ERROR_TYPES.get(status, "api_error"), message=message))


_encoder = msgspec.json.Encoder()


def encode(body: Any) -> bytes:
    """JSON bytes of a response struct."""
    return _encoder.encode(body)


def event(name: str, body: dict[str, Any]) -> bytes:
    """One Server-Sent Event as Anthropic sends them: an ``event:`` line naming it, then its JSON (with ``type``)."""
    return b"event: " + name.encode() + b"\ndata: " + _encoder.encode({"type": name, **body}) + b"\n\n"


#: The ``type`` tags of content blocks: a validation error's location names the tag after a list index.
_BLOCK_TAGS = frozenset(
    tag for block in get_args(get_args(ContentBlockParam)[0]) for tag in get_args(block.model_fields["type"].annotation)
)


def describe_validation_error(exc: ValidationError) -> str:
    """One message naming each bad field as Anthropic names them (``messages.0.content: ...``)."""
    parts = []
    for error in exc.errors():
        if error["type"] == "json_invalid":
            reason = (error.get("ctx") or {}).get("error") or error["msg"]
            return f"The request body is not valid JSON: {reason}."
        loc = error["loc"]
        if loc and loc[-1] == "str" and not isinstance(error.get("input"), str):
            continue  # the text branch of a text-or-blocks field: the blocks branch says what is wrong
        field = ".".join(str(part) for part in _field_path(loc))
        parts.append(f"{field}: {error['msg']}" if field else error["msg"])
    unique = list(dict.fromkeys(parts)) or ["The request body is invalid."]
    return "; ".join(unique[:4]) + (f" (and {len(unique) - 4} more)" if len(unique) > 4 else "")


def _field_path(loc: tuple[int | str, ...]) -> list[int | str]:
    """``loc`` without pydantic's union branch names (``list[...]``) and block tags."""
    path: list[int | str] = []
    after_index = False
    for part in loc:
        tag = after_index and part in _BLOCK_TAGS
        after_index = isinstance(part, int)
        if not tag and not (isinstance(part, str) and "[" in part):
            path.append(part)
    return path


def stop_reason_of(finish_reason: str | None, stop_reason: int | str | None, called: bool) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a sample's finish (``called``: the reply holds tool calls)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None
