"""OpenAI's response shapes as msgspec structs: encoded straight to JSON, fast enough for one chunk per token.

Every field is written, ``null`` included, as vLLM writes them; only the parts of a streamed ``delta`` are left out
while unset, as OpenAI streams them.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec


def now() -> int:
    return int(time.time())


class Response(msgspec.Struct):
    """Base of every response body."""


class Delta(msgspec.Struct, omit_defaults=True):
    """Base of the parts of a streamed delta: unset fields are left out."""


class UsageInfo(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": N}: prompt tokens not computed


class CompletionLogprobs(Response):
    """Legacy completions logprobs: parallel lists, plus each position's top alternatives."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(Response):
    """A ``text_completion`` object (also each streamed chunk, as OpenAI streams completions)."""

    id: str
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    created: int = msgspec.field(default_factory=now)
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a KV connector's, for the next engine (vLLM's field)


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Response):
    content: list[TokenLogprob] | None


class FunctionCall(Response):
    name: str
    arguments: str


class ToolCall(Response):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(Response):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    reasoning_content: str | None = None  # with --reasoning-parser; ``reasoning`` is vLLM's newer name for it
    reasoning: str | None = None


class ChatChoice(Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(Response):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    created: int = msgspec.field(default_factory=now)
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a KV connector's, for the next engine (vLLM's field)


class DeltaFunctionCall(Delta):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Delta):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(Delta):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatStreamChoice(Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(Response):
    id: str
    model: str
    choices: list[ChatStreamChoice]
    object: str = "chat.completion.chunk"
    created: int = msgspec.field(default_factory=now)
    usage: UsageInfo | None = None


class ModelCard(Response):
    id: str
    root: str
    max_model_len: int
    object: str = "model"
    created: int = msgspec.field(default_factory=now)
    owned_by: str = "vllite"
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(Response):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(Response):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(Response):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


_encoder = msgspec.json.Encoder()


def encode(body: Any) -> bytes:
    """JSON bytes of a response struct (or any msgspec-encodable value)."""
    return _encoder.encode(body)


def sse(body: Any) -> bytes:
    """One Server-Sent Event carrying ``body`` as JSON."""
    return b"data: " + _encoder.encode(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
