"""A Responses request as the chat route's request: the conversation's items as chat messages, the function tools,
``tool_choice`` and ``text.format`` in their chat shapes. The chat machinery (template, tool and reasoning parsers,
structured outputs, sampling) then serves it unchanged.

Items become messages as the chat templates expect them: ``instructions`` a leading system message; the items of
one model turn (``reasoning``, an assistant ``message``, ``function_call`` items) one assistant message with its
``reasoning_content``, content and ``tool_calls``; each ``function_call_output`` a ``tool`` message.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    ResponseFormat,
    ToolDefinition,
)
from vllite.plugins.openai_server.responses_api.protocol import (
    PASSTHROUGH_FIELDS,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputContent,
    MessageItem,
    ReasoningInputItem,
    ResponsesRequest,
)

#: Content parts read as text.
TEXT_PARTS = ("input_text", "output_text", "text")


def input_items(request: ResponsesRequest) -> list[Any]:
    """The request's ``input`` as items (a text is one user message)."""
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)]
    return list(request.input)


def to_messages(instructions: str | None, items: list[Any], first_new: int = 0) -> list[ChatMessage]:
    """The chat messages of a conversation. ``items[first_new:]`` are the request's own ``input`` (the earlier ones
    come from ``previous_response_id``): a 400 names its index. A ``function_call_output`` must answer the
    ``call_id`` of a ``function_call`` item before it, else 400."""
    messages = [ChatMessage(role="system", content=instructions)] if instructions else []
    turn: dict[str, Any] | None = None  # the model turn being gathered
    calls: set[str] = set()

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(ChatMessage(role="assistant", **turn))
            turn = None

    for index, item in enumerate(items):
        where = f"input[{index - first_new}]"
        if isinstance(item, ReasoningInputItem):
            if turn is not None and (turn["reasoning_content"] or turn["content"] or turn["tool_calls"]):
                flush()
            turn = turn or _new_turn()
            parts = item.content if item.content else item.summary
            turn["reasoning_content"] = "\n".join(part.text for part in parts) or None
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            turn = turn or _new_turn()
            function = {"name": item.name, "arguments": item.arguments}
            turn["tool_calls"].append({"id": item.call_id, "type": "function", "function": function})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise BadRequestError(
                    f"{where}: function_call_output for call_id {item.call_id!r}, but no function_call item with that "
                    "call_id comes before it (in input or the previous response).",
                    param="input",
                )
            flush()
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output, where)))
        elif item.role == "assistant":
            if turn is not None and (turn["content"] or turn["tool_calls"]):
                flush()
            turn = turn or _new_turn()
            turn["content"] = _text(item.content, where)
        else:
            flush()
            messages.append(ChatMessage(role=item.role, content=_text(item.content, where)))
    flush()
    return messages


def _new_turn() -> dict[str, Any]:
    return {"content": None, "reasoning_content": None, "tool_calls": []}


def _text(content: str | list[InputContent], where: str) -> str:
    """A message's (or a call output's) text: its text parts joined; other parts are refused."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type in TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise BadRequestError(
                f"{where}.content: only text parts are supported (input_text, output_text), got a {part.type!r} part.",
                param="input",
            )
    return "\n".join(texts)


def to_chat_request(
    request: ResponsesRequest, messages: list[ChatMessage], *, stream: bool, request_id: str | None = None
) -> ChatCompletionRequest:
    """The chat request that serves ``request`` with ``messages`` as engine request ``request_id`` (400 when there is
    nothing to answer)."""
    if not messages or all(message.role == "system" for message in messages):
        raise BadRequestError("input has no messages to answer.", param="input")
    fields = {name: getattr(request, name) for name in PASSTHROUGH_FIELDS if name in request.model_fields_set}
    tools = [
        ToolDefinition(function=FunctionDefinition(**tool.model_dump(exclude={"type"}))) for tool in request.tools or []
    ]
    try:
        return ChatCompletionRequest(
            model=request.model,
            messages=messages,
            stream=stream,
            request_id=request_id,
            max_completion_tokens=request.max_output_tokens,
            tools=tools or None,
            tool_choice=_tool_choice(request),
            response_format=_response_format(request),
            **fields,
        )
    except ValidationError as exc:
        raise BadRequestError(f"The request cannot be served: {exc}", param="input") from None


def _tool_choice(request: ResponsesRequest) -> Any:
    """``tool_choice`` in the chat shape (a named function: ``{"type": "function", "function": {"name": ...}}``)."""
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(request: ResponsesRequest) -> ResponseFormat | None:
    """``text.format`` as the chat route's ``response_format``."""
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if not isinstance(fmt.schema_, dict) or not fmt.name:
        raise BadRequestError(
            'text.format of type json_schema needs {"name": ..., "schema": {...}} with the schema as a JSON object.',
            param="text",
        )
    return ResponseFormat(
        type="json_schema", json_schema={"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    )
