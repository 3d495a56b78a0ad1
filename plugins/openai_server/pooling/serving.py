"""What the pooling routes answer: embeddings, pooled tensors, class probabilities, pair scores and rerankings from
``AsyncLLM.encode``.

A request's inputs are all checked first (:mod:`~vllite.plugins.openai_server.pooling.prompts`), then submitted
at once, one engine request each, and gathered concurrently; if one fails, or the client goes away, the others
are aborted. ``/score`` and ``/rerank`` run a cross-encoder on each (text_1, text_2) pair where the model serves
the ``score`` task, or compare embeddings by cosine where it serves ``embed`` (each distinct text embedded once).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from typing import Any

import torch

from vllite.exceptions import RequestFailedError
from vllite.lora import LoRARequest
from vllite.outputs import PoolingRequestOutput, ScoringRequestOutput
from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.pooling.prompts import (
    check_dimensions,
    check_token_ids,
    default_pooling_task,
    input_list,
    need_tokenizer,
    require_task,
    tokenize_inputs,
    truncation_length,
)
from vllite.plugins.openai_server.pooling.protocol import (
    ActivationFields,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    pooling_usage,
)
from vllite.plugins.openai_server.protocol import random_id
from vllite.plugins.pooling.scoring import cosine_scores, score_prompt
from vllite.pooling_params import PoolingParams

EMBED_TASKS = ("embed", "token_embed")


async def create_embedding(ctx: ServerContext, request: EmbeddingRequest) -> EmbeddingResponse:
    """``POST /v1/embeddings``."""
    model, lora_request = pooling_model(ctx, request.model)
    require_task(ctx, "/v1/embeddings", "embed")
    check_dimensions(ctx, request.dimensions)
    prompts = _token_prompts(ctx, request.input, request)
    params = PoolingParams(task="embed", dimensions=request.dimensions, normalize=request.normalize)
    request_id = request.request_id or random_id("embd-")
    outputs = await encode_all(ctx, request_id, prompts, params, priority=request.priority, lora=lora_request)
    data = [
        EmbeddingData(index=i, embedding=encode_tensor(out.outputs.data, request.encoding_format, flat=True))
        for i, out in enumerate(outputs)
    ]
    return EmbeddingResponse(id=request_id, model=model, data=data, usage=pooling_usage(_prompt_tokens(outputs)))


async def create_pooling(ctx: ServerContext, request: PoolingRequest) -> PoolingResponse:
    """``POST /pooling``: the pooled tensor of the request's task (default: the model's first) for each input."""
    model, lora_request = pooling_model(ctx, request.model)
    task = request.task or default_pooling_task(ctx, "/pooling")
    require_task(ctx, f"/pooling with task {task!r}", task)
    if task in EMBED_TASKS:
        check_dimensions(ctx, request.dimensions)
    elif request.dimensions is not None:
        raise BadRequestError(f"dimensions applies to the embed tasks, not to {task!r}.", param="dimensions")
    prompts = _token_prompts(ctx, request.input, request)
    params = PoolingParams(
        task=task,
        dimensions=request.dimensions,
        normalize=request.normalize,
        use_activation=request.activation_flag(),
    )
    request_id = request.request_id or random_id("pool-")
    outputs = await encode_all(ctx, request_id, prompts, params, priority=request.priority, lora=lora_request)
    data = [
        PoolingData(index=i, data=encode_tensor(out.outputs.data, request.encoding_format))
        for i, out in enumerate(outputs)
    ]
    return PoolingResponse(id=request_id, model=model, data=data, usage=pooling_usage(_prompt_tokens(outputs)))


async def create_classification(ctx: ServerContext, request: ClassificationRequest) -> ClassificationResponse:
    """``POST /classify``: each input's class probabilities and its most likely label (the config's ``id2label``)."""
    model, lora_request = pooling_model(ctx, request.model)
    require_task(ctx, "/classify", "classify")
    prompts = _token_prompts(ctx, request.input, request)
    params = PoolingParams(task="classify", use_activation=request.activation_flag())
    request_id = request.request_id or random_id("classify-")
    outputs = await encode_all(ctx, request_id, prompts, params, priority=request.priority, lora=lora_request)
    labels = _id2label(ctx)
    data = []
    for i, out in enumerate(outputs):
        probs = [float(p) for p in out.outputs.data.reshape(-1).tolist()]
        best = max(range(len(probs)), key=probs.__getitem__) if probs else None
        label = labels.get(best) if best is not None else None
        data.append(ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs)))
    return ClassificationResponse(id=request_id, model=model, data=data, usage=pooling_usage(_prompt_tokens(outputs)))


async def create_score(ctx: ServerContext, request: ScoreRequest) -> ScoreResponse:
    """``POST /score``: ``text_1`` against each of ``text_2`` (one to many), or pairwise."""
    model, lora_request = pooling_model(ctx, request.model)
    texts_1 = [request.text_1] if isinstance(request.text_1, str) else list(request.text_1)
    texts_2 = [request.text_2] if isinstance(request.text_2, str) else list(request.text_2)
    for name, texts in (("text_1", texts_1), ("text_2", texts_2)):
        if not texts:
            raise BadRequestError(f"{name} must not be an empty list.", param=name)
    if len(texts_1) == 1:
        texts_1 = texts_1 * len(texts_2)
    elif len(texts_1) != len(texts_2):
        raise BadRequestError(
            f"text_1 has {len(texts_1)} texts and text_2 {len(texts_2)}: give one text_1 (scored against each "
            "text_2) or lists of one length (scored pairwise).",
            param="text_1",
        )
    request_id = request.request_id or random_id("score-")
    scores, tokens = await score_pairs(
        ctx, "/score", request, texts_1, texts_2, request_id, ("text_1", "text_2"), lora_request
    )
    data = [ScoreData(index=i, score=score) for i, score in enumerate(scores)]
    return ScoreResponse(id=request_id, model=model, data=data, usage=pooling_usage(tokens))


async def create_rerank(ctx: ServerContext, request: RerankRequest, route: str = "/rerank") -> RerankResponse:
    """``POST /rerank``: the documents by relevance to the query, most relevant first, the first ``top_n``."""
    model, lora_request = pooling_model(ctx, request.model)
    documents = request.document_texts()
    if not documents:
        raise BadRequestError("documents must not be an empty list.", param="documents")
    if request.top_n is not None and request.top_n < 0:
        raise BadRequestError(f"top_n must be 0 or more (0: every document), got {request.top_n}.", param="top_n")
    request_id = request.request_id or random_id("rerank-")
    queries = [request.query] * len(documents)
    scores, tokens = await score_pairs(
        ctx, route, request, queries, documents, request_id, ("query", "documents"), lora_request
    )
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    if request.top_n:
        order = order[: request.top_n]
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            document=RerankDocument(text=documents[i]) if request.return_documents else None,
        )
        for i in order
    ]
    usage = RerankUsage(prompt_tokens=tokens, total_tokens=tokens)
    return RerankResponse(id=request_id, model=model, usage=usage, results=results)


async def score_pairs(
    ctx: ServerContext,
    route: str,
    request: ActivationFields,
    texts_1: Sequence[str],
    texts_2: Sequence[str],
    request_id: str,
    params_names: tuple[str, str],
    lora_request: LoRARequest | None,
) -> tuple[list[float], int]:
    """One score per pair and the prompt tokens spent: a cross-encoder's where the model serves ``score``, else
    the cosine similarity of the two texts' embeddings."""
    task = require_task(ctx, route, "score", "embed")
    priority = request.priority
    if task == "score":
        num_labels = getattr(ctx.engine.config.model_config.hf_config, "num_labels", 1)
        if num_labels != 1:
            raise BadRequestError(
                f"{route} needs a cross-encoder with one label (a relevance score), and this model classifies into "
                f"{num_labels} labels: use /classify.",
                param="model",
            )
        keep = truncation_length(ctx, request.truncate_prompt_tokens)
        prompts = [
            _pair_prompt(ctx, t1, t2, keep, f"{params_names[1]}[{i}]", params_names[1])
            for i, (t1, t2) in enumerate(zip(texts_1, texts_2, strict=True))
        ]
        params = PoolingParams(task="score", use_activation=request.activation_flag())
        outputs = await encode_all(ctx, request_id, prompts, params, priority=priority, lora=lora_request)
        scores = [float(ScoringRequestOutput.from_base(out).outputs.score) for out in outputs]
        return scores, _prompt_tokens(outputs)
    where: dict[str, tuple[str, str]] = {}  # each distinct text, and how an error names it (its first place)
    for name, texts in zip(params_names, (texts_1, texts_2), strict=True):
        distinct = len(set(texts)) > 1 or name == params_names[1]
        for i, text in enumerate(texts):
            where.setdefault(text, (f"{name}[{i}]" if distinct else name, name))
    unique = list(where)
    ids = [
        tokenize_inputs(
            ctx,
            [text],
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            add_special_tokens=request.add_special_tokens,
            param=where[text][1],
            names=[where[text][0]],
        )[0]
        for text in unique
    ]
    prompts = [{"prompt_token_ids": token_ids} for token_ids in ids]
    outputs = await encode_all(
        ctx, request_id, prompts, PoolingParams(task="embed"), priority=priority, lora=lora_request
    )
    embedding = {text: out.outputs.data for text, out in zip(unique, outputs, strict=True)}
    similarities = cosine_scores([embedding[t] for t in texts_1], [embedding[t] for t in texts_2])
    return [float(s) for s in similarities], _prompt_tokens(outputs)


def _pair_prompt(ctx: ServerContext, text_1: str, text_2: str, keep: int | None, where: str, param: str) -> Any:
    """A cross-encoder's prompt for one pair (``score_prompt``), cut to its last ``keep`` tokens as the engine cuts
    a prompt (``LLM.score`` gives the same); 400 if it is over the context length."""
    prompt = dict(score_prompt(need_tokenizer(ctx, param), text_1, text_2))
    if keep is not None:
        for key in ("prompt_token_ids", "token_type_ids"):
            if prompt.get(key) is not None:
                prompt[key] = list(prompt[key])[-keep:]
    check_token_ids(ctx, prompt["prompt_token_ids"], where, param)
    return prompt


async def encode_all(
    ctx: ServerContext,
    request_id: str,
    prompts: Sequence[Any],
    params: PoolingParams,
    *,
    priority: int = 0,
    lora: LoRARequest | None = None,
) -> list[PoolingRequestOutput]:
    """Each prompt's final output, in prompt order: all submitted at once (``{request_id}-{i}``) and gathered
    concurrently; if one fails, or this is cancelled, the others are aborted."""
    ctx.log_prompt(request_id, [p["prompt_token_ids"] for p in prompts], params)

    async def one(index: int, prompt: Any) -> PoolingRequestOutput:
        final = None
        sub_id = f"{request_id}-{index}" if len(prompts) > 1 else request_id
        async for output in ctx.engine.encode(prompt, params.clone(), sub_id, lora_request=lora, priority=priority):
            final = output
        if final is None or final.error is not None or final.outputs.data is None:
            reason = final.error if final is not None else None
            raise RequestFailedError(f"The request failed in the engine: {reason or 'it returned no result'}")
        return final

    tasks = [asyncio.ensure_future(one(i, prompt)) for i, prompt in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()  # its ``encode`` aborts its engine request
        if pending:
            await asyncio.wait(pending)
        for task in tasks:  # the exceptions gather did not raise are retrieved, not logged as lost
            if not task.cancelled():
                task.exception()


def encode_tensor(data: torch.Tensor, encoding_format: str, *, flat: bool = False) -> list[Any] | str:
    """A pooled tensor as JSON lists (nested as it is; ``flat``: one list), or (``base64``) as base64 of its values'
    little-endian float32 bytes, as OpenAI encodes embeddings."""
    values = data.detach().to("cpu", torch.float32)
    if encoding_format == "base64":
        return base64.b64encode(values.contiguous().numpy().astype("<f4").tobytes()).decode("ascii")
    return values.reshape(-1).tolist() if flat else values.tolist()


def pooling_model(ctx: ServerContext, name: str | None) -> tuple[str, LoRARequest | None]:
    """The served name a pooling request asks for, and the LoRA adapter it names (``None``: the base model)."""
    model = ctx.check_model(name)
    return model, ctx.loras.adapters.get(model)


def _token_prompts(ctx: ServerContext, value: Any, request: Any) -> list[dict[str, Any]]:
    ids = tokenize_inputs(
        ctx,
        input_list(value),
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        add_special_tokens=request.add_special_tokens,
    )
    return [{"prompt_token_ids": token_ids} for token_ids in ids]


def _prompt_tokens(outputs: Sequence[PoolingRequestOutput]) -> int:
    return sum(len(out.prompt_token_ids or ()) for out in outputs)


def _id2label(ctx: ServerContext) -> dict[int, str]:
    """The model's class labels by index (its config's ``id2label``)."""
    hf_config = getattr(ctx.engine.config.model_config, "hf_config", None)
    labels = getattr(hf_config, "id2label", None) or {}
    return {int(k): str(v) for k, v in labels.items()}
