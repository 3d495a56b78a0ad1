"""``LLM``'s pooling API, as vLLM spells it: ``embed``, ``classify``, ``score``, ``reward`` and ``encode``.

Each call submits every prompt with ``PoolingParams`` for its task and runs the engine until all are done; the
results come back in input order. A request that fails (say, an input over ``max_model_len``) raises
``ValueError`` naming it once every other request has finished: the engine serves on. The signatures are the
kernel's; ``encode`` and ``score`` run the pooling plugin's loop (``vllite.plugins.pooling.llm_api``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from vllite.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from vllite.pooling_params import PoolingParams

if TYPE_CHECKING:
    from vllite.engine.input_processor import PromptType
    from vllite.engine.llm import LLM
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
        from vllite.plugins.pooling.llm_api import encode

        return encode(
            cast("LLM", self), prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, lora_request=lora_request, pooling_task=pooling_task,
        )  # fmt: skip

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
        from vllite.plugins.pooling.llm_api import score

        kwargs: dict[str, Any] = {"truncate_prompt_tokens": truncate_prompt_tokens, "use_tqdm": use_tqdm}
        return score(cast("LLM", self), data_1, data_2, pooling_params, lora_request, **kwargs)
