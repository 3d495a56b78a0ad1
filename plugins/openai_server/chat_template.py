"""A conversation (OpenAI messages, optionally tools) to prompt token ids through the model's chat template.

The template is, in order: the request's ``chat_template`` (only with ``--trust-request-chat-template``), the
server's ``--chat-template``, the tokenizer's own. Text content parts are joined; other parts (images, audio)
are refused. An assistant message's ``tool_calls`` reach the template with their arguments as a dict, as
Hugging Face templates expect them, and its ``reasoning_content`` (or ``reasoning``) as ``reasoning_content``.
Roles outside OpenAI's set and keys a message carries beyond OpenAI's reach the template unchanged, as vLLM passes
them (templates that know a ``documents`` role or a per-message ``thinking`` key read them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.protocol import ChatMessage


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the plain dicts a Jinja chat template reads."""
    out = []
    for index, message in enumerate(messages):
        item: dict[str, Any] = dict(message.model_extra or {})
        item.update(role=message.role, content=_text_content(message, index))
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if reasoning is not None:
            item["reasoning_content"] = reasoning  # what reasoning models' templates read (Qwen3, DeepSeek)
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments, index)},
                }
                for call in message.tool_calls
            ]
        out.append(item)
    return out


def render_messages(
    ctx: ServerContext,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt token ids of ``messages``; :class:`BadRequestError` for a conversation the template cannot render."""
    from vllite.engine.tokenizer import apply_chat_template

    if ctx.tokenizer is None:
        raise BadRequestError("Chat needs a tokenizer; this server was started without one (--skip-tokenizer-init).")
    if continue_final_message and add_generation_prompt:
        raise BadRequestError(
            "continue_final_message and add_generation_prompt cannot both be true.", param="continue_final_message"
        )
    if continue_final_message and messages[-1].role != "assistant":
        raise BadRequestError(
            "continue_final_message needs the last message to be an assistant message.", param="messages"
        )
    if chat_template is not None and not ctx.settings.trust_request_chat_template:
        raise BadRequestError(
            "A chat_template in the request is refused unless the server runs with --trust-request-chat-template.",
            param="chat_template",
        )
    template = chat_template or ctx.settings.chat_template
    kwargs = dict(chat_template_kwargs or {})
    reserved = {"tokenize", "chat_template", "tools", "add_generation_prompt", "continue_final_message"} & set(kwargs)
    if reserved:
        raise BadRequestError(f"chat_template_kwargs may not set {sorted(reserved)}.", param="chat_template_kwargs")
    try:
        return apply_chat_template(
            ctx.tokenizer,
            message_dicts(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template=template,
            **kwargs,
        )
    except BadRequestError:
        raise
    except Exception as exc:  # Jinja errors, a template's raise_exception(), no template at all
        raise BadRequestError(f"The chat template could not render the messages: {exc}", param="messages") from None


def _text_content(message: ChatMessage, index: int) -> str | None:
    content = message.content
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise BadRequestError(
                f"messages[{index}].content: only text parts are supported, got a {part.type!r} part.",
                param="messages",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(arguments: str, index: int) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        raise BadRequestError(
            f"messages[{index}].tool_calls: function.arguments must be a JSON object as text.", param="messages"
        ) from None
