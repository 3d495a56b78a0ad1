"""What ``LLM.encode`` and ``LLM.score`` run (the kernel's methods keep vLLM's signatures and forward here).

``encode`` submits every prompt with ``PoolingParams`` for its task and runs the engine until all are done; the
results come back in input order. A request that fails (say, an input over ``max_model_len``) raises
``ValueError`` naming it once every other request has finished: the engine serves on. ``score`` reads each pair
with a cross-encoder, or scores the cosine similarity of an embedding model's two embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllite.outputs import PoolingOutput, PoolingRequestOutput, ScoringRequestOutput
from vllite.plugins.pooling.scoring import cosine_scores, pair_up, score_prompt
from vllite.pooling_params import PoolingParams

if TYPE_CHECKING:
    from vllite.engine.llm import LLM
    from vllite.lora import LoRARequest

PoolingParamsArg = PoolingParams | Sequence[PoolingParams] | None


def encode(
    llm: LLM,
    prompts: Any,
    pooling_params: PoolingParamsArg,
    *,
    truncate_prompt_tokens: int | None,
    use_tqdm: bool,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    pooling_task: str | None,
) -> list[PoolingRequestOutput]:
    """``LLM.encode``: pools every prompt for ``pooling_task`` (default: the model's first task)."""
    from vllite.lora.request import lora_per_prompt

    task = pooling_task or llm.supported_tasks[0]
    prompt_list = _as_list(prompts)
    prepared = []
    for params in _params(pooling_params, len(prompt_list)):
        params = params.with_task(task)
        if truncate_prompt_tokens is not None:
            params.truncate_prompt_tokens = truncate_prompt_tokens
        prepared.append(params)
    llm._add_requests(prompt_list, prepared, None, lora_per_prompt(lora_request, len(prompt_list)))
    outputs: list[PoolingRequestOutput] = llm._run_engine(use_tqdm=use_tqdm)  # type: ignore[assignment]
    failed = [f"prompt {i}: {out.error}" for i, out in enumerate(outputs) if out.error is not None]
    if failed:
        raise ValueError(f"{len(failed)} of {len(outputs)} pooling requests failed: " + "; ".join(failed[:5]))
    return outputs


def score(
    llm: LLM,
    data_1: str | Sequence[str],
    data_2: str | Sequence[str],
    pooling_params: PoolingParams | None,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    **kwargs: Any,
) -> list[ScoringRequestOutput]:
    """``LLM.score``: a cross-encoder (a one-label classification model) reads each pair together; an embedding
    model scores the cosine similarity of the two embeddings. ``kwargs``: ``truncate_prompt_tokens``,
    ``use_tqdm``."""
    pairs = pair_up(data_1, data_2)
    tasks = llm.supported_tasks
    if "score" in tasks:
        num_labels = getattr(llm.llm_engine.config.model_config.hf_config, "num_labels", 1)
        if num_labels != 1:
            raise ValueError(f"score needs a cross-encoder with one label; this model has {num_labels}.")
        tokenizer = llm.llm_engine.tokenizer
        prompts = [score_prompt(tokenizer, a, b) for a, b in pairs]
        outputs = encode(llm, prompts, pooling_params, lora_request=lora_request, pooling_task="score", **kwargs)
        return [ScoringRequestOutput.from_base(out) for out in outputs]
    if "embed" not in tasks:
        raise ValueError(f"score needs a cross-encoder or an embedding model; this model supports {', '.join(tasks)}.")
    texts = [a for a, _ in pairs] + [b for _, b in pairs]
    embedded = encode(llm, texts, pooling_params, lora_request=lora_request, pooling_task="embed", **kwargs)
    vectors = [out.outputs.data for out in embedded]
    scores = cosine_scores(vectors[: len(pairs)], vectors[len(pairs) :])
    return [
        ScoringRequestOutput.from_base(_score_output(str(i), embedded[i], embedded[len(pairs) + i], value))
        for i, value in enumerate(scores)
    ]


def _as_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    result = list(prompts)
    if not result:
        raise ValueError("No prompts given: pass at least one input.")
    return result


def _params(pooling_params: PoolingParamsArg, n: int) -> list[PoolingParams]:
    if pooling_params is None:
        return [PoolingParams() for _ in range(n)]
    if isinstance(pooling_params, PoolingParams):
        return [pooling_params] * n
    params = list(pooling_params)
    if len(params) != n:
        raise ValueError(f"The lengths of prompts ({n}) and pooling_params ({len(params)}) must be the same.")
    return params


def _score_output(
    request_id: str, first: PoolingRequestOutput, second: PoolingRequestOutput, value: float
) -> PoolingRequestOutput:
    import torch

    prompt = first.prompt_token_ids + second.prompt_token_ids
    return PoolingRequestOutput(request_id, PoolingOutput(torch.tensor([value])), prompt)
