"""``POST /v1/responses``: OpenAI's Responses request (pydantic, unknown fields refused) and the response objects it
returns (msgspec structs, encoded as they are written).

The request takes OpenAI's fields and, like the chat route, vLLM's sampling extras and the Continuum fork's program
fields. Input items are messages (``type`` may be left out, as OpenAI allows), ``function_call``,
``function_call_output`` and ``reasoning`` items: exactly what a previous response's ``output`` holds, so a client
can send its items back as they came.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from vllite.plugins.openai_server.protocol import RequestModel
from vllite.plugins.openai_server.responses import now

# ---------------------------------------------------------------------------------------------------- request


class Item(BaseModel):
    """An input item: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid")


class InputContent(BaseModel):
    """A content part of a message: ``input_text`` / ``output_text`` (``text``) or ``refusal``. Other parts (images,
    files, audio) pass validation so that the route can name them in its 400."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(Item):
    """A message of the conversation; an assistant message is an earlier reply."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputContent]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Item):
    """A function call the model made (an output item of an earlier response)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None
    async_: bool | None = Field(default=None, alias="async")


class FunctionCallOutputItem(Item):
    """The result of a function call, for the ``call_id`` of an earlier ``function_call`` item."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputContent]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningPart(Item):
    """A part of a reasoning item: its text (``reasoning_text``) or a summary of it (``summary_text``)."""

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInputItem(Item):
    """An earlier reply's reasoning; ``content`` (else ``summary``) reaches the chat template."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value: Any) -> str:
    """The tag of an input item: its ``type``, ``message`` when it has none (OpenAI's easy input message)."""
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(RequestModel):
    """A function the model may call (the Responses shape: ``name`` and ``parameters`` at the top)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(RequestModel):
    """``tool_choice: {"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with ``name``, ``schema`` and ``strict``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    """``text``: the reply's format (``verbosity`` is accepted and has no effect)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(RequestModel):
    """``POST /v1/responses``: OpenAI's fields, then vLLM's sampling extras, then Continuum's."""

    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    # OpenAI's fields accepted without effect here: echoed where the response has them
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    stream_options: dict[str, Any] | None = None
    # vLLM's extras (as the chat route takes them)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1)  # the prefix-cache namespace (vLLM: non-empty)
    vllm_xargs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Continuum (the fork's fields)
    job_id: str | int | None = None
    is_last_step: bool | None = None
    this_func_call: str | None = None
    last_func_call: str | None = None


#: Fields handed to the chat machinery unchanged (when the request sets them).
PASSTHROUGH_FIELDS = (
    "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "priority", "cache_salt", "vllm_xargs", "extra_args", "chat_template_kwargs",
    "job_id", "is_last_step", "this_func_call", "last_func_call", "user", "temperature", "top_p", "parallel_tool_calls",
)  # fmt: skip

# ---------------------------------------------------------------------------------------------------- response

Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    """An ``output_text`` part of a message item."""

    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    """The text of a reasoning item."""

    text: str


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    """The reply's text, as one ``output_text`` part."""

    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"


class FunctionCallOutput(msgspec.Struct, tag_field="type", tag="function_call"):
    """A call the model made; the client answers it with a ``function_call_output`` item for ``call_id``."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningOutput(msgspec.Struct, tag_field="type", tag="reasoning"):
    """The reply's reasoning, split off by the server's reasoning parser."""

    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    encrypted_content: str | None = None
    status: str = "completed"


OutputItem = OutputMessage | FunctionCallOutput | ReasoningOutput


class ResponseUsage(msgspec.Struct):
    """Token counts: the prompt's (``cached_tokens`` of them served from the prefix cache) and the reply's
    (``reasoning_tokens`` of them in its reasoning)."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class ResponseObject(msgspec.Struct):
    """A ``response`` object: the reply's output items, its status and usage, and the request's settings."""

    id: str
    model: str
    status: Status
    output: list[OutputItem]
    created_at: int = msgspec.field(default_factory=now)
    object: str = "response"
    completed_at: int | None = None
    background: bool = False
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_logprobs: int = 0
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
