"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the chat route.

A request becomes a chat completion request and runs through the chat route's own generation
(:func:`~vllite.plugins.openai_server.chat.start_chat`): the chat template, the server's tool-call and reasoning
parsers, structured outputs for forced tools, the thinking budget. Its reply is shaped as Anthropic's ``Message``:

- ``system`` becomes the first (system) message; a ``tool_use`` block an assistant tool call (its ``input`` the
  arguments); each ``tool_result`` block a ``tool`` message (before the text of its user turn), which must answer a
  ``tool_use`` of an earlier assistant turn; ``thinking`` blocks the assistant's ``reasoning_content``. A
  conversation that ends with an assistant turn (without tool calls) is continued, as Anthropic continues it.
- ``tool_choice``: ``auto`` (the default with tools) needs ``--tool-call-parser``; ``any`` constrains the reply to
  calls of the tools; ``tool`` constrains it to the named tool's input; ``none`` leaves the reply text.
- ``thinking``: ``enabled`` / ``adaptive`` / ``disabled`` set the template's ``enable_thinking`` and ``thinking``
  arguments (the request's ``chat_template_kwargs`` win), and ``budget_tokens`` becomes the thinking budget.
- The reply: a ``thinking`` block (with ``--reasoning-parser``), a ``text`` block, then one ``tool_use`` block per
  call; ``stop_reason`` ``tool_use``, ``max_tokens``, ``stop_sequence`` (naming it) or ``end_turn``.
"""

from __future__ import annotations

import json
from typing import Any

from vllite.plugins.openai_server.anthropic.protocol import (
    ContentBlock,
    ConversationFields,
    CountTokensRequest,
    Message,
    MessageParam,
    MessagesRequest,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ToolResultBlockParam,
    ToolUseBlock,
    Usage,
    stop_reason_of,
)
from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.event_stream import EventStream
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    NamedFunction,
    NamedToolChoice,
    ToolCallObject,
    random_id,
)
from vllite.plugins.openai_server.responses import ChatCompletionResponse

#: Anthropic's ``tool_choice`` types as the chat route's.
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


async def create_message(
    ctx: ServerContext, body: MessagesRequest, *, data_parallel_rank: int | None = None
) -> Message | EventStream:
    """The ``Message``, or (``stream``) its SSE events; raises ``BadRequestError`` before anything is submitted."""
    from vllite.plugins.openai_server.anthropic.stream import stream_message
    from vllite.plugins.openai_server.chat import collect_chat, start_chat

    request = chat_request(body)
    run = await start_chat(ctx, request, data_parallel_rank=data_parallel_rank)
    if body.stream:
        return EventStream(stream_message(run), run.submitted.abort_unfinished)
    return message_of(await collect_chat(ctx, request, run))


async def count_tokens(ctx: ServerContext, body: CountTokensRequest) -> dict[str, int]:
    """``{"input_tokens": N}``: the prompt ``/v1/messages`` would render for the same conversation and tools."""
    from vllite.plugins.openai_server.chat_template import render_messages

    await ctx.resolve_model(body.model)
    request = chat_request(body)
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    prompt_ids = render_messages(
        ctx,
        request.messages,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        tools=tools,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    return {"input_tokens": len(prompt_ids)}


def chat_request(body: ConversationFields) -> ChatCompletionRequest:
    """The chat completion request ``body`` asks for; :class:`BadRequestError` for a conversation that cannot be
    one (a block in the wrong turn, a ``tool_result`` answering no ``tool_use``, an image)."""
    messages = chat_messages(body)
    last = body.messages[-1]
    prefill = last.role == "assistant" and not messages[-1].tool_calls
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
        "chat_template_kwargs": _template_kwargs(body),
    }
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in body.tools
        ]
    if body.tool_choice is not None:
        fields.update(_tool_choice(body))
    if isinstance(body, MessagesRequest):
        fields.update(_generation_fields(body))
    return ChatCompletionRequest(**fields)


def _generation_fields(body: MessagesRequest) -> dict[str, Any]:
    budget = body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None
    fields = {
        "max_tokens": body.max_tokens,
        "stop": body.stop_sequences,
        "stream": body.stream,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "priority": body.priority,
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "vllm_xargs": body.vllm_xargs,
        "thinking_token_budget": budget,
        "request_id": random_id("msg_"),
    }
    return {key: value for key, value in fields.items() if value is not None}


def _template_kwargs(body: ConversationFields) -> dict[str, Any] | None:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.thinking is not None:
        thinking = body.thinking.type != "disabled"
        kwargs.setdefault("enable_thinking", thinking)  # Qwen3's name
        kwargs.setdefault("thinking", thinking)  # DeepSeek-V3.1's and Granite's
    return kwargs or None


def _tool_choice(body: ConversationFields) -> dict[str, Any]:
    choice = body.tool_choice
    assert choice is not None
    fields: dict[str, Any] = {}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if choice.type != "tool":
        fields["tool_choice"] = TOOL_CHOICES[choice.type]
        return fields
    if not choice.name:
        raise BadRequestError('tool_choice of type "tool" needs the tool\'s name.', param="tool_choice")
    fields["tool_choice"] = NamedToolChoice(function=NamedFunction(name=choice.name))
    return fields


def chat_messages(body: ConversationFields) -> list[ChatMessage]:
    """``system`` and ``messages`` as the chat template's messages (see the module docstring)."""
    out: list[ChatMessage] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else "\n".join(block.text for block in body.system)
        out.append(ChatMessage(role="system", content=system))
    tool_use_ids: set[str] = set()
    for index, message in enumerate(body.messages):
        if message.role == "assistant":
            out.append(_assistant_message(message, index, tool_use_ids))
        else:
            out.extend(_user_messages(message, index, tool_use_ids))
    return out


def _assistant_message(message: MessageParam, index: int, tool_use_ids: set[str]) -> ChatMessage:
    if isinstance(message.content, str):
        return ChatMessage(role="assistant", content=message.content)
    texts, thoughts, calls = [], [], []
    for position, block in enumerate(message.content):
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "thinking":
            thoughts.append(block.thinking)
        elif block.type == "tool_use":
            tool_use_ids.add(block.id)
            calls.append(ToolCallObject(id=block.id, function=FunctionCall(name=block.name, arguments=_json(block))))
        elif block.type != "redacted_thinking":
            raise _misplaced(index, position, block.type, "assistant")
    return ChatMessage(
        role="assistant",
        content="".join(texts) if texts or not calls else None,
        tool_calls=calls or None,
        reasoning_content="\n".join(thoughts) if thoughts else None,
    )


def _user_messages(message: MessageParam, index: int, tool_use_ids: set[str]) -> list[ChatMessage]:
    """A user turn's tool results (as ``tool`` messages, first, as templates expect them after the calls), then its
    text."""
    if isinstance(message.content, str):
        return [ChatMessage(role="user", content=message.content)]
    results, texts = [], []
    for position, block in enumerate(message.content):
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_result":
            if block.tool_use_id not in tool_use_ids:
                raise BadRequestError(
                    f"messages.{index}.content.{position}: tool_result's tool_use_id {block.tool_use_id!r} answers no "
                    "tool_use block of an earlier assistant turn.",
                    param="messages",
                )
            results.append(_tool_message(block, index, position))
        else:
            raise _misplaced(index, position, block.type, "user")
    text = [ChatMessage(role="user", content="\n".join(texts))] if texts or not results else []
    return results + text


def _tool_message(block: ToolResultBlockParam, index: int, position: int) -> ChatMessage:
    content = block.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, TextBlockParam):
                raise BadRequestError(
                    f"messages.{index}.content.{position}.content: only text blocks are supported in a tool_result, "
                    f"got a {part.type!r} block.",
                    param="messages",
                )
            parts.append(part.text)
        content = "\n".join(parts)
    return ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=content or "")


def _misplaced(index: int, position: int, kind: str, role: str) -> BadRequestError:
    if kind in ("tool_use", "tool_result", "thinking", "text"):
        where = "an assistant" if kind in ("tool_use", "thinking") else "a user"
        reason = f"a {kind!r} block belongs in {where} turn, not a {role} turn"
    else:
        reason = f"{kind!r} blocks are not supported (text, tool_use, tool_result and thinking are)"
    return BadRequestError(f"messages.{index}.content.{position}: {reason}.", param="messages")


def _json(block: Any) -> str:
    return json.dumps(block.input, ensure_ascii=False)


def message_of(response: ChatCompletionResponse) -> Message:
    """The Anthropic ``Message`` of a whole chat completion (its one choice)."""
    choice = response.choices[0]
    reply = choice.message
    content: list[ContentBlock] = []
    if reply.reasoning_content:
        content.append(ThinkingBlock(thinking=reply.reasoning_content))
    if reply.content:
        content.append(TextBlock(text=reply.content))
    for call in reply.tool_calls:
        arguments = _tool_input(call.function.arguments)
        if arguments is None:  # no JSON object (a forced call cut off by max_tokens): it stays the text it is
            content.append(TextBlock(text=call.function.arguments))
        else:
            content.append(ToolUseBlock(id=call.id, name=call.function.name, input=arguments))
    stop_reason, stop_sequence = stop_reason_of(choice.finish_reason, choice.stop_reason, bool(reply.tool_calls))
    usage = response.usage
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
    return Message(
        id=response.id,
        model=response.model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=Usage(usage.prompt_tokens - cached, usage.completion_tokens, cache_read_input_tokens=cached),
    )


def _tool_input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
