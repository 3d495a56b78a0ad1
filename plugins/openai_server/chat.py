"""``POST /v1/chat/completions``: a conversation through the chat template, whole or streamed, with tool calls.

Tool calling, by ``tool_choice``:

- ``none`` (the default without tools): the text is the answer.
- ``auto`` (the default with tools; needs ``--tool-call-parser``): the parser finds the calls in the text; the
  answer carries ``tool_calls`` and ``finish_reason="tool_calls"``, and the text outside the calls as content.
  Streaming withholds text from where a call may begin, then sends each call as one ``tool_calls`` delta.
- ``required``: the reply is constrained (structured outputs) to vLLM's JSON format ``[{"name": ...,
  "parameters": {...}}]``: one or more calls of the given tools, each with arguments valid for its schema. Cut short
  by ``max_tokens``, it keeps the calls it completed (no content, ``finish_reason="length"``, as vLLM).
- a named function: the whole text is that function's arguments (vLLM's behaviour), constrained to its schema and
  streamed as argument deltas.

``response_format`` (``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` constrain the reply too
(:mod:`vllite.plugins.openai_server.structured`). With ``--reasoning-parser``, the reply's reasoning is split off
first (:mod:`vllite.plugins.openai_server.reasoning`): tool calls and constraints apply to the content after it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from vllite.outputs import CompletionOutput, RequestOutput
from vllite.plugins.openai_server.chat_template import render_messages
from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.errors import check_sample, error_event
from vllite.plugins.openai_server.event_stream import EventStream
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.logprobs import PromptLogprobsJSON, chat_logprobs, prompt_logprobs_json
from vllite.plugins.openai_server.protocol import ChatCompletionRequest, random_id
from vllite.plugins.openai_server.reasoning import ReasoningMode
from vllite.plugins.openai_server.responses import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
    sse,
)
from vllite.plugins.openai_server.sampling import (
    build_sampling_params,
    check_common_fields,
    check_logprob_token_ids,
    check_max_tokens,
)
from vllite.plugins.openai_server.streams import Submitted, submit
from vllite.plugins.openai_server.structured import chat_constraint
from vllite.plugins.openai_server.tool_choice import ToolMode, resolve_tool_mode


class ChatResponse(ChatCompletionResponse):
    """A whole chat response with vLLM's ``prompt_logprobs`` (the rendered prompt's logprobs, when asked for)."""

    prompt_logprobs: PromptLogprobsJSON | None = None


@dataclass
class ChatRun:
    """A chat request submitted to the engine: how its reply is read (tool and reasoning modes), its engine request,
    and what its response reports (id, served model name, prompt). Other routes that generate through the chat
    template (``/v1/messages``) start one too and shape the reply their own way."""

    mode: ToolMode
    reasoning: ReasoningMode
    submitted: Submitted
    request_id: str
    model: str
    prompt_ids: list[int]
    final: RequestOutput | None = None  # already finished (``use_beam_search``): nothing to read from ``submitted``


async def create_chat_completion(
    ctx: ServerContext, request: ChatCompletionRequest, *, data_parallel_rank: int | None = None
) -> ChatCompletionResponse | EventStream:
    """The response body, or (``stream``) its SSE events; raises ``BadRequestError`` before anything is submitted.
    ``data_parallel_rank``: the engine the ``X-data-parallel-rank`` header names."""
    run = await start_chat(ctx, request, data_parallel_rank=data_parallel_rank)
    if request.stream:
        events = _stream(ctx, request, run.mode, run.reasoning, run.submitted, run.request_id, run.model)
        return EventStream(events, run.submitted.abort_unfinished)
    return await collect_chat(ctx, request, run)


async def start_chat(
    ctx: ServerContext, request: ChatCompletionRequest, *, data_parallel_rank: int | None = None
) -> ChatRun:
    """Checks, renders and submits ``request``; raises ``BadRequestError`` before anything is submitted."""
    model, lora_request = await ctx.resolve_model(request.model)
    check_common_fields(request, max_logprobs=ctx.max_logprobs)
    if request.top_logprobs is not None and not request.logprobs:
        raise BadRequestError("top_logprobs needs logprobs to be true.", param="top_logprobs")
    check_logprob_token_ids(
        request,
        logprobs_field="logprobs (true)",
        logprobs_set=bool(request.logprobs),
    )
    mode = resolve_tool_mode(ctx, request)
    constraint = chat_constraint(request, ctx.structured_outputs_config)
    prompt_ids = render_messages(
        ctx,
        request.messages,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        tools=mode.template_tools,
        chat_template=request.chat_template,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    if request.truncation_side == "right" and request.truncate_prompt_tokens is not None:
        # The engine truncates on the left (keeps the last tokens); the right side is cut here.
        keep = ctx.max_model_len if request.truncate_prompt_tokens == -1 else request.truncate_prompt_tokens
        prompt_ids = prompt_ids[:keep]
    reasoning = ReasoningMode.for_request(ctx, request, prompt_ids)
    if mode.skip_special_tokens is False or reasoning.skip_special_tokens is False:
        request.skip_special_tokens = False  # the parser reads markers that are special tokens (vLLM does the same)
    max_tokens_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(request, max_tokens_field)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = build_sampling_params(
        request,
        ctx.model_defaults,
        max_tokens=max_tokens,
        logprobs=logprobs,
        structured_outputs=constraint,
        vocab_size=ctx.engine.engine_info.vocab_size,
    )
    reasoning.apply(ctx, params, request.thinking_token_budget, constrained=constraint is not None)
    check_max_tokens(
        max_tokens,
        [len(prompt_ids)],
        max_model_len=ctx.max_model_len,
        param=max_tokens_field,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
    )
    request_id = request.request_id or random_id("chatcmpl-")
    if request.use_beam_search:
        from vllite.plugins.openai_server.beam_search import beam_search_params, run_beam_search

        beam_params = beam_search_params(request, ctx, max_tokens)
        [final] = await run_beam_search(
            ctx,
            request_id,
            [prompt_ids],
            beam_params,
            lora_request=lora_request,
            priority=request.priority,
            cache_salt=request.cache_salt,
            data_parallel_rank=data_parallel_rank,
        )
        return ChatRun(mode, reasoning, Submitted(ctx.engine, []), request_id, model, prompt_ids, final)
    ctx.log_prompt(request_id, prompt_ids, params)
    submitted = await submit(
        ctx.engine,
        request_id,
        [prompt_ids],
        params,
        priority=request.priority,
        cache_salt=request.cache_salt,
        data_parallel_rank=data_parallel_rank,
        lora_request=lora_request,
    )
    return ChatRun(mode, reasoning, submitted, request_id, model, prompt_ids)


async def collect_chat(ctx: ServerContext, request: ChatCompletionRequest, run: ChatRun) -> ChatCompletionResponse:
    """The whole response of a started chat, once every sample has finished."""
    mode, reasoning, submitted = run.mode, run.reasoning, run.submitted
    request_id, model, prompt_ids = run.request_id, run.model, run.prompt_ids
    final = run.final
    try:
        async for _, output in submitted.outputs():
            final = output
    finally:
        await submitted.abort_unfinished()
    assert final is not None
    choices = []
    completion_tokens = 0
    echoed = echo_text(request)
    for sample in final.outputs:
        check_sample(sample)
        completion_tokens += len(sample.token_ids)
        thought, answer = reasoning.split(sample.text)
        content, calls = mode.extract(answer)
        if reasoning.active and not content:
            content = None
        if echoed:
            content = echoed + (content or "")
        finish_reason = mode.finish_reason(sample.finish_reason, calls)
        choices.append(
            ChatChoice(
                index=sample.index,
                message=AssistantMessage(
                    content=content, tool_calls=calls, reasoning_content=thought, reasoning=thought
                ),
                logprobs=_logprobs(ctx, request, sample),
                finish_reason=finish_reason,
                stop_reason=sample.stop_reason,
                token_ids=list(sample.token_ids) if request.return_token_ids else None,
            )
        )
    prompt_tokens = len(prompt_ids)
    cached = {"cached_tokens": final.num_cached_tokens}
    usage = UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, cached)
    return ChatResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=usage,
        prompt_token_ids=prompt_ids if request.return_token_ids else None,
        kv_transfer_params=final.kv_transfer_params,
        prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
    )


def echo_text(request: ChatCompletionRequest) -> str:
    """With ``echo`` (vLLM's field): the last message's text when its role is the reply's (``assistant`` with a
    generation prompt, else the last message's own role, so always), which the reply then starts with."""
    if not request.echo:
        return ""
    last = request.messages[-1]
    reply_role = "assistant" if request.add_generation_prompt else last.role
    if last.role != reply_role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text or "" for part in last.content if part.type == "text")


def _logprobs(ctx: ServerContext, request: ChatCompletionRequest, sample: CompletionOutput) -> ChatLogprobs | None:
    if not request.logprobs:
        return None
    as_ids = bool(request.return_tokens_as_token_ids)
    top = request.top_logprobs or 0
    return chat_logprobs(
        sample.token_ids, sample.logprobs or [], top, ctx.tokenizer, as_token_ids=as_ids, only=request.logprob_token_ids
    )


async def _stream(
    ctx: ServerContext,
    request: ChatCompletionRequest,
    mode: ToolMode,
    reasoning: ReasoningMode,
    submitted: Submitted,
    request_id: str,
    model: str,
) -> AsyncIterator[bytes]:
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    continuous = include_usage and request.stream_options is not None and request.stream_options.continuous_usage_stats
    extractors = [reasoning.wrap(mode.stream()) for _ in range(request.n)]
    prompt_tokens = completion_tokens = 0

    def chunk(choices: list[ChatStreamChoice]) -> bytes:
        usage = UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens) if continuous else None
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage))

    try:
        yield chunk(
            [
                ChatStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None
                )
                for i in range(request.n)
            ]
        )
        if echoed := echo_text(request):
            yield chunk(
                [
                    ChatStreamChoice(index=i, delta=DeltaMessage(content=echoed), logprobs=None, finish_reason=None)
                    for i in range(request.n)
                ]
            )
        async for _, output in submitted.outputs():
            prompt_tokens = len(output.prompt_token_ids or ())
            choices = []
            for sample in output.outputs:
                if sample.finish_reason == "error":
                    yield error_event(sample.error or "the request failed in the engine", 500)
                    return
                completion_tokens += len(sample.token_ids)
                choices.extend(_stream_choices(ctx, request, mode, extractors[sample.index], sample))
            if choices:
                yield chunk(choices)
        if include_usage:
            usage = UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
            yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage))
        yield SSE_DONE
    except Exception as exc:
        yield error_event(exc)
        yield SSE_DONE
    finally:
        await submitted.abort_unfinished()


def _stream_choices(
    ctx: ServerContext, request: ChatCompletionRequest, mode: ToolMode, extractor: Any, sample: CompletionOutput
) -> list[ChatStreamChoice]:
    """The choice (at most one: a chunk has one choice per index, as vLLM's) one sample's step delta becomes: its
    content and tool-call deltas merged, with its finish."""
    deltas = extractor.feed(sample.text)
    finished = sample.finish_reason is not None
    calls: list[DeltaToolCall] = []
    if finished:
        more, calls = extractor.finish()
        deltas.extend(more)
    delta = merge_deltas(deltas)
    logprobs = _logprobs(ctx, request, sample)
    token_ids = list(sample.token_ids) if request.return_token_ids else None
    if delta is None and logprobs is None and not token_ids and not finished:
        return []
    return [
        ChatStreamChoice(
            index=sample.index,
            delta=delta or DeltaMessage(),
            logprobs=logprobs,
            finish_reason=mode.finish_reason(sample.finish_reason, calls) if finished else None,
            stop_reason=sample.stop_reason if finished else None,
            token_ids=token_ids,
        )
    ]


def merge_deltas(deltas: list[DeltaMessage]) -> DeltaMessage | None:
    """One delta for a sample's deltas of one step (reasoning, content, tool calls): texts joined in order, the
    tool-call deltas listed in order; ``None`` for none."""
    if len(deltas) <= 1:
        return deltas[0] if deltas else None
    merged = DeltaMessage()
    for delta in deltas:
        merged.role = delta.role if delta.role is not None else merged.role
        for name in ("content", "reasoning_content", "reasoning"):
            text = getattr(delta, name)
            if text is not None:
                setattr(merged, name, (getattr(merged, name) or "") + text)
        if delta.tool_calls:
            merged.tool_calls = [*(merged.tool_calls or []), *delta.tool_calls]
    return merged
