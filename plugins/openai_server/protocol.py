"""OpenAI's request and response shapes (pydantic), with vLLM's documented extra request fields.

Requests reject unknown fields (HTTP 400 naming the field); vLLM's extras that vllite supports are declared here
so that clients written for vLLM run unchanged. The response shapes are in ``responses``.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: The signed 64-bit range vLLM accepts for ``seed`` (the engine's wire format and per-request generators use it).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def random_id(prefix: str) -> str:
    """An OpenAI-style object id: ``cmpl-…``, ``chatcmpl-…``, ``call_…``."""
    return f"{prefix}{uuid.uuid4().hex}"


class RequestModel(BaseModel):
    """A request body: unknown fields are an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(RequestModel):
    """``stream_options``: a final chunk with ``usage`` (``include_usage``), or usage on every chunk too."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestModel):
    """The sampling fields both generation routes share: OpenAI's, then vLLM's extras, then Continuum's."""

    model: str | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    # Score exactly these token ids at every generated position (returned as the position's top logprobs)
    logprob_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    # 'left' keeps the prompt's last truncate_prompt_tokens tokens (the default), 'right' its first ones
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool = False
    # Logprob tokens as "token_id:N" strings (tokens that are not valid UTF-8 on their own stay identifiable)
    return_tokens_as_token_ids: bool | None = None
    # Beam search (a frontend loop over the engine): n is the beam width
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = Field(None, min_length=1)  # the prefix-cache namespace (vLLM: non-empty)
    vllm_xargs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None
    # Structured outputs (vLLM's field): {"json": {...}} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} ...
    structured_outputs: dict[str, Any] | None = None
    # End the output once it repeats an N-gram (vLLM's field): {"max_pattern_size", "min_pattern_size", "min_count"}
    repetition_detection: dict[str, Any] | None = None
    # KV connectors (prefill/decode disaggregation): what the prefill server returned, passed to the decode server
    kv_transfer_params: dict[str, Any] | None = None
    # Continuum (the fork's fields): which agent program a request belongs to, and whether it is its last turn
    job_id: str | int | None = None
    is_last_step: bool | None = None
    this_func_call: str | None = None
    last_func_call: str | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's: base64 strings of torch.save'd [num_tokens, hidden_size] tensors (--enable-prompt-embeds).
    prompt_embeds: str | list[str] | None = None
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True


class FunctionDefinition(RequestModel):
    """A function the model may call: its name, description and JSON-schema parameters."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    """One entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    """A call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallObject(BaseModel):
    """A call in an assistant message of the conversation history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are supported (``{"type": "text", "text": ...}``)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A message of the conversation. ``role`` is usually one of system, developer, user, assistant, tool; other
    roles and keys the message carries beyond OpenAI's reach the chat template as they are (vLLM's behaviour)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallObject] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content


class ResponseFormat(RequestModel):
    """``response_format``: ``text``, ``json_object``, or ``json_schema`` with ``{"name", "schema", "strict"}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # vLLM's extras
    echo: bool = False  # the reply starts with the last message's content when its role is the reply's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Reasoning (with --reasoning-parser): return the reasoning; cap its tokens (the thinking-budget processor)
    include_reasoning: bool = True
    thinking_token_budget: int | None = None


class TokenizeRequest(RequestModel):
    """``POST /tokenize``: a prompt, or messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # vLLM's chat tokenize fields: the prompt exactly as /v1/chat/completions would render it
    continue_final_message: bool = False
    tools: list[ToolDefinition] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestModel):
    """``POST /v1/load_lora_adapter`` (vLLM's; with ``VLLITE_ALLOW_RUNTIME_LORA_UPDATING=1``)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's; ``lora_int_id`` is accepted and ignored: the name decides)."""

    lora_name: str
    lora_int_id: int | None = None
