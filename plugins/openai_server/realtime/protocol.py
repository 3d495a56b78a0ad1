"""``/v1/realtime``: the client events of OpenAI's Realtime API that the text subset takes (pydantic, unknown fields
refused), and the server events it sends (plain JSON objects in the GA shapes of the ``openai`` package's
``types/realtime``).

Client events: ``session.update``, ``conversation.item.create`` (messages with text content),
``response.create`` and ``response.cancel``. Server events: ``session.created`` / ``session.updated``,
``conversation.item.added`` / ``conversation.item.done``, the ``response.*`` stream of one text message, and
``error``.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError

from vllite.plugins.openai_server.http_errors import RealtimeEventError

# ---------------------------------------------------------------------------------------------- client events


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SessionConfig(_Strict):
    """The session fields a ``session.update`` may set. ``temperature`` is beyond OpenAI's GA shape (the beta API had
    it); tools are accepted only empty."""

    type: Literal["realtime"] = "realtime"
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | Literal["inf"] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    output_modalities: list[Literal["text"]] | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["auto", "none"] | None = None


class ContentPart(BaseModel):
    """A content part of a message item; parts other than text (audio, images) pass validation so that the route can
    name them in its error."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class MessageItem(_Strict):
    """A message to add to the conversation: its text is appended to the session's input as is."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "assistant"]
    content: list[ContentPart]
    id: str | None = Field(default=None, min_length=1, max_length=64)
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class ResponseConfig(_Strict):
    """The per-response fields of ``response.create``; ``instructions`` only before the session's first response."""

    instructions: str | None = None
    max_output_tokens: PositiveInt | Literal["inf"] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    output_modalities: list[Literal["text"]] | None = None
    conversation: Literal["auto"] | None = None
    metadata: dict[str, str] | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["auto", "none"] | None = None


class SessionUpdate(_Strict):
    type: Literal["session.update"]
    event_id: str | None = None
    session: SessionConfig


class ItemCreate(_Strict):
    type: Literal["conversation.item.create"]
    event_id: str | None = None
    previous_item_id: str | None = None
    item: MessageItem


class ResponseCreate(_Strict):
    type: Literal["response.create"]
    event_id: str | None = None
    response: ResponseConfig | None = None


class ResponseCancel(_Strict):
    type: Literal["response.cancel"]
    event_id: str | None = None
    response_id: str | None = None


ClientEvent = SessionUpdate | ItemCreate | ResponseCreate | ResponseCancel
#: The client event types served, by ``type``.
CLIENT_EVENTS: dict[str, type[ClientEvent]] = {
    "session.update": SessionUpdate,
    "conversation.item.create": ItemCreate,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
}


def parse_client_event(data: object) -> ClientEvent:
    """The client event in a decoded JSON message; :class:`RealtimeEventError` naming the bad field otherwise."""
    if not isinstance(data, dict):
        raise RealtimeEventError("A client event must be a JSON object.", code="invalid_event")
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    model = CLIENT_EVENTS.get(kind) if isinstance(kind, str) else None
    if model is None:
        served = ", ".join(CLIENT_EVENTS)
        raise RealtimeEventError(
            f"Unknown or unsupported event type {kind!r}; this server takes {served}.",
            code="unknown_event_type",
            param="type",
            event_id=event_id,
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise RealtimeEventError(message, code="invalid_value", param=param, event_id=event_id) from None


_BRANCH = re.compile(r"[\[\-]")  # "constrained-int", "literal['inf']", "function-after[...]"
_TYPE_NAMES = ("int", "float", "str", "bool", "list", "dict")


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """One message naming every bad field (dotted paths), and the first one."""
    parts, params = [], []
    for error in exc.errors():
        # a union (``int | "inf"``) reports each branch it tried under the branch's name: keep the field's path,
        # and one message per field
        loc = [str(p) for p in error.get("loc", ()) if not _BRANCH.search(str(p)) and p not in _TYPE_NAMES]
        field = ".".join(loc)
        if field in params:
            continue
        if error.get("type") == "extra_forbidden":
            parts.append(f"Unknown or unsupported field {field!r}.")
        elif error.get("type") == "missing":
            parts.append(f"Missing required field {field!r}.")
        else:
            parts.append(f"{field}: {error.get('msg', 'invalid value')} (got {repr(error.get('input'))[:80]}).")
        params.append(field)
    unique = list(dict.fromkeys(parts))
    return " ".join(unique[:4]), params[0] if params else None


# ---------------------------------------------------------------------------------------------- server events


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``event_…``, ``item_…``, ``resp_…``, ``sess_…``."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def server_event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event of ``kind`` with a fresh ``event_id``."""
    return {"type": kind, "event_id": new_id("event_"), **fields}


def error_event(exc: RealtimeEventError | str, *, code: str = "server_error", kind: str | None = None) -> dict:
    """An ``error`` event: a refused client event (``invalid_request_error``) or a server failure."""
    if isinstance(exc, RealtimeEventError):
        error = {"type": "invalid_request_error", "code": exc.code, "message": str(exc), "param": exc.param}
        error["event_id"] = exc.event_id
    else:
        error = {"type": kind or "server_error", "code": code, "message": exc, "param": None, "event_id": None}
    return server_event("error", error=error)


def session_object(session_id: str, model: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The session resource of ``session.created`` / ``session.updated``: the effective configuration."""
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "output_modalities": ["text"],
        "instructions": settings.get("instructions") or "",
        "max_output_tokens": settings.get("max_output_tokens") or "inf",
        "temperature": settings.get("temperature"),
        "tools": [],
        "tool_choice": "auto",
    }


def message_item(item_id: str, role: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """A message item of the conversation (an assistant item in progress has no content yet)."""
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": role, "status": status,
            "content": content}  # fmt: skip


def usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    """A response's usage: ``input_tokens`` is the whole context the turn ran on, ``cached_tokens`` the part of it
    whose KV was reused."""
    return {
        "total_tokens": input_tokens + output_tokens,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_token_details": {
            "text_tokens": input_tokens,
            "audio_tokens": 0,
            "image_tokens": 0,
            "cached_tokens": cached_tokens,
            "cached_tokens_details": {"text_tokens": cached_tokens, "audio_tokens": 0, "image_tokens": 0},
        },
        "output_token_details": {"text_tokens": output_tokens, "audio_tokens": 0},
    }


def response_object(
    response_id: str,
    conversation_id: str,
    status: str,
    *,
    max_output_tokens: int | str,
    metadata: dict[str, str] | None,
    output: list[dict[str, Any]] | None = None,
    status_details: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response resource of ``response.created`` / ``response.done``."""
    return {
        "id": response_id,
        "object": "realtime.response",
        "status": status,
        "status_details": status_details,
        "output": output or [],
        "conversation_id": conversation_id,
        "output_modalities": ["text"],
        "max_output_tokens": max_output_tokens,
        "metadata": metadata,
        "usage": usage,
    }


#: A turn's finish reason → the response's status and its ``status_details``.
FINISH_STATUS: dict[str | None, tuple[str, dict[str, Any] | None]] = {
    "stop": ("completed", None),
    "length": ("incomplete", {"type": "incomplete", "reason": "max_output_tokens"}),
}
