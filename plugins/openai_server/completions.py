"""``POST /v1/completions``: one or several prompts (text or token ids), whole or streamed as Server-Sent Events.

Choice ``i * n + j`` is sample ``j`` of prompt ``i``, as OpenAI numbers them. A non-streaming response waits for
every sample; a stream sends each sample's text as it is generated, one chunk per engine step and prompt, a
chunk with its ``finish_reason`` at its end, then (``stream_options.include_usage``) a usage chunk and
``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from vllite.outputs import CompletionOutput, RequestOutput
from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.errors import check_sample, error_event
from vllite.plugins.openai_server.event_stream import EventStream
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.logprobs import PromptLogprobsJSON, completion_logprobs, prompt_logprobs_json
from vllite.plugins.openai_server.protocol import CompletionRequest, random_id
from vllite.plugins.openai_server.responses import (
    SSE_DONE,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
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
from vllite.plugins.openai_server.structured import structured_outputs_field


class PromptLogprobsChoice(CompletionChoice):
    """A whole response's choice with vLLM's ``prompt_logprobs`` (the prompt's logprobs, on every sample of it)."""

    prompt_logprobs: PromptLogprobsJSON | None = None


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """The request's prompts as a list: one text, several texts, one token list or several token lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("prompt must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if any(isinstance(p, list) and not p for p in prompt):
        raise BadRequestError("prompt must not contain an empty token list.", param="prompt")
    return list(prompt)


async def create_completion(
    ctx: ServerContext, request: CompletionRequest, *, data_parallel_rank: int | None = None
) -> CompletionResponse | EventStream:
    """The response body, or (``stream``) an iterator of SSE events; raises ``BadRequestError`` before submitting.
    ``data_parallel_rank``: the engine the ``X-data-parallel-rank`` header names."""
    model, lora_request = await ctx.resolve_model(request.model)
    check_common_fields(request, max_logprobs=ctx.max_logprobs)
    check_logprob_token_ids(
        request,
        logprobs_field="logprobs",
        logprobs_set=request.logprobs is not None,
    )
    if request.logprob_token_ids and request.echo and request.max_tokens == 0:
        raise BadRequestError(
            "logprob_token_ids is not supported with echo=true and max_tokens=0: no tokens are generated.",
            param="logprob_token_ids",
        )
    if request.best_of is not None and request.best_of != request.n:
        raise BadRequestError(
            f"best_of={request.best_of} is not supported (vllite returns every sample); use n instead.",
            param="best_of",
        )
    if request.suffix is not None:
        raise BadRequestError("suffix is not supported.", param="suffix")
    embeds_prompts = _embeds_prompts(ctx, request)
    prompts = normalize_prompts(request.prompt) if request.prompt not in (None, "") or not embeds_prompts else []
    echo_logprobs = request.echo and request.logprobs is not None
    params = build_sampling_params(
        request,
        ctx.model_defaults,
        max_tokens=request.max_tokens,
        logprobs=request.logprobs,
        structured_outputs=structured_outputs_field(request, ctx.structured_outputs_config),
        prompt_logprobs=request.logprobs if echo_logprobs else None,
        vocab_size=ctx.engine.engine_info.vocab_size,
    )
    request_id = request.request_id or random_id("cmpl-")
    if request.use_beam_search:
        return await _beam_search(ctx, request, prompts, request_id, model, lora_request, data_parallel_rank)
    engine_prompts = embeds_prompts + _engine_prompts(ctx, request, prompts)
    check_max_tokens(
        request.max_tokens if "max_tokens" in request.model_fields_set else None,
        _token_counts(engine_prompts),
        max_model_len=ctx.max_model_len,
        param="max_tokens",
        truncate_prompt_tokens=request.truncate_prompt_tokens,
    )
    ctx.log_prompt(request_id, ["<prompt_embeds>"] * len(embeds_prompts) + prompts, params)
    submitted = await submit(
        ctx.engine,
        request_id,
        engine_prompts,
        params,
        priority=request.priority,
        cache_salt=request.cache_salt,
        data_parallel_rank=data_parallel_rank,
        lora_request=lora_request,
    )
    if request.stream:
        return EventStream(_stream(ctx, request, submitted, request_id, model), submitted.abort_unfinished)
    return await _collect(ctx, request, submitted, request_id, model)


def _embeds_prompts(ctx: ServerContext, request: CompletionRequest) -> list[dict[str, Any]]:
    """The request's ``prompt_embeds`` as engine prompts (they come before the ``prompt`` prompts, as in vLLM);
    ``BadRequestError`` for a bad tensor, a server without ``--enable-prompt-embeds``, or what embeds cannot do."""
    if request.prompt_embeds is None:
        if request.prompt is None:
            raise BadRequestError("Either prompt or prompt_embeds must be provided.", param="prompt")
        return []
    for field, unsupported in (("echo", request.echo), ("use_beam_search", request.use_beam_search)):
        if unsupported:
            raise BadRequestError(f"{field} is not supported with prompt_embeds.", param=field)
    from vllite.plugins.openai_server.prompt_embeds import load_prompt_embeds

    return load_prompt_embeds(request.prompt_embeds, ctx.engine.engine_info, request.truncate_prompt_tokens)


def _engine_prompts(ctx: ServerContext, request: CompletionRequest, prompts: list[str | list[int]]) -> list[Any]:
    """The prompts as the engine gets them. With ``add_special_tokens=false``, texts become ids without special
    tokens. With an explicit ``max_tokens``, texts are tokenized here, once (the engine takes the ids, and the text
    rides along as ``RequestOutput.prompt``), so that the request can be checked against the context. With
    ``truncation_side="right"``, each prompt is cut here to its first ``truncate_prompt_tokens`` tokens (the
    engine keeps the last ones)."""
    if request.truncation_side == "right" and request.truncate_prompt_tokens is not None:
        keep = ctx.max_model_len if request.truncate_prompt_tokens == -1 else request.truncate_prompt_tokens
        return [(_encode(ctx, p, request.add_special_tokens) if isinstance(p, str) else p)[:keep] for p in prompts]
    if not request.add_special_tokens:
        return [_encode_plain(ctx, p) if isinstance(p, str) else p for p in prompts]
    if "max_tokens" not in request.model_fields_set or request.max_tokens is None or ctx.tokenizer is None:
        return list(prompts)
    return [
        {"prompt": p, "prompt_token_ids": [int(t) for t in ctx.tokenizer.encode(p)]} if isinstance(p, str) else p
        for p in prompts
    ]


def _token_counts(prompts: list[Any]) -> list[int]:
    """The token count of each prompt given as ids (texts the server did not tokenize are not counted)."""
    return [
        len(p) if isinstance(p, list) else len(p.get("prompt_embeds", p.get("prompt_token_ids")))
        for p in prompts
        if not isinstance(p, str)
    ]


def _encode_plain(ctx: ServerContext, text: str) -> list[int]:
    return _encode(ctx, text, add_special_tokens=False)


def _encode(ctx: ServerContext, text: str, add_special_tokens: bool) -> list[int]:
    if ctx.tokenizer is None:
        raise BadRequestError("Text prompts need a tokenizer; this server has none.", param="prompt")
    return [int(t) for t in ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)]


async def _beam_search(
    ctx: ServerContext,
    request: CompletionRequest,
    prompts: list[str | list[int]],
    request_id: str,
    model: str,
    lora_request: Any,
    data_parallel_rank: int | None,
) -> CompletionResponse:
    """``use_beam_search``: the best ``n`` beams of each prompt as its choices, best first."""
    from vllite.plugins.openai_server.beam_search import beam_search_params, run_beam_search

    params = beam_search_params(request, ctx, request.max_tokens)
    token_prompts = [(_encode(ctx, p, request.add_special_tokens) if isinstance(p, str) else list(p)) for p in prompts]
    if request.truncate_prompt_tokens is not None:
        keep = ctx.max_model_len if request.truncate_prompt_tokens == -1 else request.truncate_prompt_tokens
        right = request.truncation_side == "right"
        token_prompts = [ids[:keep] if right else ids[-keep:] for ids in token_prompts]
    check_max_tokens(
        request.max_tokens if "max_tokens" in request.model_fields_set else None,
        [len(ids) for ids in token_prompts],
        max_model_len=ctx.max_model_len,
        param="max_tokens",
    )
    outputs = await run_beam_search(
        ctx,
        request_id,
        token_prompts,
        params,
        prompt_texts=[p if isinstance(p, str) else None for p in prompts],
        lora_request=lora_request,
        priority=request.priority,
        cache_salt=request.cache_salt,
        data_parallel_rank=data_parallel_rank,
    )
    return _response(ctx, request, dict(enumerate(outputs)), request_id, model)


async def _collect(
    ctx: ServerContext, request: CompletionRequest, submitted: Submitted, request_id: str, model: str
) -> CompletionResponse:
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in submitted.outputs():
            finals[index] = output
    finally:
        await submitted.abort_unfinished()
    return _response(ctx, request, finals, request_id, model)


def _response(
    ctx: ServerContext, request: CompletionRequest, finals: dict[int, RequestOutput], request_id: str, model: str
) -> CompletionResponse:
    """The whole response from each prompt's final output (``finals[i]``: prompt ``i``'s)."""
    choices: list[CompletionChoice] = []
    prompt_tokens = completion_tokens = 0
    for index in range(len(finals)):
        output = finals[index]
        prompt_tokens += len(output.prompt_token_ids or ())
        for sample in output.outputs:
            check_sample(sample)
            completion_tokens += len(sample.token_ids)
            choices.append(_choice(ctx, request, output, sample, index, echo=request.echo, whole=True))
    cached = sum(output.num_cached_tokens for output in finals.values())
    usage = UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, {"cached_tokens": cached})
    # One prompt's KV connector params (vLLM returns them for single-prompt requests, as disaggregation sends them).
    kv_params = finals[0].kv_transfer_params if len(finals) == 1 else None
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage, kv_transfer_params=kv_params)


def _choice(
    ctx: ServerContext,
    request: CompletionRequest,
    output: RequestOutput,
    sample: CompletionOutput,
    prompt_index: int,
    *,
    echo: bool,
    with_prompt_ids: bool = True,
    whole: bool = False,
) -> CompletionChoice:
    """One choice of a response or of a chunk: the sample's new text (after the prompt when echoing); a ``whole``
    response's choice carries the prompt's logprobs when the engine computed them (vLLM's ``prompt_logprobs``)."""
    text = sample.text
    logprobs: CompletionLogprobs | None = None
    prompt_text = ""
    if echo:
        prompt_text = _prompt_text(ctx, output)
        text = prompt_text + text
    if request.logprobs is not None:
        token_ids: list[int] = list(sample.token_ids)
        positions: list[Any] = list(sample.logprobs or ())
        if echo:
            prompt_ids = list(output.prompt_token_ids or ())
            token_ids = prompt_ids + token_ids
            positions = list(output.prompt_logprobs or [None] * len(prompt_ids)) + positions
        as_ids = bool(request.return_tokens_as_token_ids)
        logprobs = completion_logprobs(
            token_ids, positions, request.logprobs, ctx.tokenizer, as_token_ids=as_ids, only=request.logprob_token_ids
        )
    fields: dict[str, Any] = {"prompt_logprobs": prompt_logprobs_json(output.prompt_logprobs)} if whole else {}
    return (PromptLogprobsChoice if whole else CompletionChoice)(
        index=prompt_index * request.n + sample.index,
        text=text,
        logprobs=logprobs,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
        token_ids=list(sample.token_ids) if request.return_token_ids else None,
        prompt_token_ids=list(output.prompt_token_ids or ()) if request.return_token_ids and with_prompt_ids else None,
        **fields,
    )


def _prompt_text(ctx: ServerContext, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    if ctx.tokenizer is None:
        return ""
    return ctx.tokenizer.decode(output.prompt_token_ids or [])


async def _stream(
    ctx: ServerContext, request: CompletionRequest, submitted: Submitted, request_id: str, model: str
) -> AsyncIterator[bytes]:
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    continuous = include_usage and request.stream_options is not None and request.stream_options.continuous_usage_stats
    started: set[int] = set()  # prompts whose first chunk (echo, prompt token ids) has gone out
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    try:
        async for index, output in submitted.outputs():
            prompt_tokens[index] = len(output.prompt_token_ids or ())
            choices = []
            for sample in output.outputs:
                if sample.finish_reason == "error":
                    yield error_event(sample.error or "the request failed in the engine", 500)
                    return
                first = index not in started
                echo = request.echo and first
                if not (sample.text or sample.token_ids or sample.finish_reason or echo):
                    continue
                completion_tokens += len(sample.token_ids)
                choices.append(_choice(ctx, request, output, sample, index, echo=echo, with_prompt_ids=first))
            started.add(index)
            if choices:
                usage = _usage(prompt_tokens, completion_tokens) if continuous else None
                yield sse(CompletionResponse(id=request_id, model=model, choices=choices, usage=usage))
        if include_usage:
            yield sse(
                CompletionResponse(
                    id=request_id, model=model, choices=[], usage=_usage(prompt_tokens, completion_tokens)
                )
            )
        yield SSE_DONE
    except Exception as exc:
        yield error_event(exc)
        yield SSE_DONE
    finally:
        await submitted.abort_unfinished()


def _usage(prompt_tokens: dict[int, int], completion_tokens: int) -> UsageInfo:
    total_prompt = sum(prompt_tokens.values())
    return UsageInfo(total_prompt, completion_tokens, total_prompt + completion_tokens)
