"""``LLM``'s pooling API, as vLLM spells it: ``embed``, ``classify``, ``score``, ``reward`` and ``encode``.

Each call submits every prompt with ``PoolingParams`` for its task and runs the engine until all are done; the
results come back in input order. A request that fails (say, an input over ``max_model_len``) raises
``ValueError`` naming it once every other request has finished: the engine serves on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllite.engine.pooling import cosine_scores, pair_up, score_prompt
from vllite.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from vllite.pooling_params import PoolingParams

if TYPE_CHECKING:
    from vllite.engine.input_processor import PromptType
    from vllite.lora import LoRARequest

PoolingParamsArg = PoolingParams | Sequence[PoolingParams] | None


class LLMPoolingAPI:
    """The pooling methods of :class:`~vllite.LLM` (a pooling model: ``runner="pooling"``, or detected)."""

    llm_engine: Any

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """What the model does: ``("generate",)``, or its pooling tasks (``"embed"``, ``"classify"``, ...)."""
        return tuple(self.llm_engine.engine_info.supported_tasks)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParamsArg = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pools every prompt for ``pooling_task`` (default: the model's first task); ``outputs.data`` is the
        raw tensor (a vector, or one row per token for ``token_embed`` / ``token_classify``)."""
        task = pooling_task or self.supported_tasks[0]
        prompt_list = _as_list(prompts)
        params_list = _params(pooling_params, len(prompt_list))
        prepared = []
        for params in params_list:
            params = params.with_task(task)
            if truncate_prompt_tokens is not None:
                params.truncate_prompt_tokens = truncate_prompt_tokens
            prepared.append(params)
        from vllite.engine.llm import _per_prompt

        self._add_requests(prompt_list, prepared, None, _per_prompt(lora_request, len(prompt_list)))  # type: ignore[attr-defined]
        outputs: list[PoolingRequestOutput] = self._run_engine(use_tqdm=use_tqdm)  # type: ignore[attr-defined]
        failed = [f"prompt {i}: {out.error}" for i, out in enumerate(outputs) if out.error is not None]
        if failed:
            raise ValueError(f"{len(failed)} of {len(outputs)} pooling requests failed: " + "; ".join(failed[:5]))
        return outputs

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParamsArg = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``)."""
        outputs = self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
            lora_request=lora_request, pooling_task="embed",
        )  # fmt: skip
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParamsArg = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``outputs.probs``)."""
        outputs = self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
            lora_request=lora_request, pooling_task="classify",
        )  # fmt: skip
        return [ClassificationRequestOutput.from_base(out) for out in outputs]

    def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParamsArg = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Per-token rewards (``token_classify``): ``outputs.data`` has one row per prompt token."""
        return self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
            lora_request=lora_request, pooling_task="token_classify",
        )  # fmt: skip

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance scores of text pairs: ``data_1[i]`` with ``data_2[i]``, or one ``data_1`` with each of
        ``data_2``. A cross-encoder (a one-label classification model) reads each pair together; an embedding
        model scores the cosine similarity of the two embeddings."""
        pairs = pair_up(data_1, data_2)
        tasks = self.supported_tasks
        kwargs: dict[str, Any] = {"truncate_prompt_tokens": truncate_prompt_tokens, "use_tqdm": use_tqdm}
        if "score" in tasks:
            num_labels = getattr(self.llm_engine.config.model_config.hf_config, "num_labels", 1)
            if num_labels != 1:
                raise ValueError(f"score needs a cross-encoder with one label; this model has {num_labels}.")
            tokenizer = self.llm_engine.tokenizer
            prompts = [score_prompt(tokenizer, a, b) for a, b in pairs]
            outputs = self.encode(prompts, pooling_params, lora_request=lora_request, pooling_task="score", **kwargs)
            return [ScoringRequestOutput.from_base(out) for out in outputs]
        if "embed" not in tasks:
            raise ValueError(
                f"score needs a cross-encoder or an embedding model; this model supports {', '.join(tasks)}."
            )
        texts = [a for a, _ in pairs] + [b for _, b in pairs]
        embedded = self.encode(texts, pooling_params, lora_request=lora_request, pooling_task="embed", **kwargs)
        vectors = [out.outputs.data for out in embedded]
        scores = cosine_scores(vectors[: len(pairs)], vectors[len(pairs) :])
        return [
            ScoringRequestOutput.from_base(_score_output(str(i), embedded[i], embedded[len(pairs) + i], score))
            for i, score in enumerate(scores)
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
    request_id: str, first: PoolingRequestOutput, second: PoolingRequestOutput, score: float
) -> PoolingRequestOutput:
    import torch

    from vllite.outputs import PoolingOutput

    prompt = first.prompt_token_ids + second.prompt_token_ids
    return PoolingRequestOutput(request_id, PoolingOutput(torch.tensor([score])), prompt)
