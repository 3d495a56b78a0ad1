"""``PoolingParams``: what a request to a pooling model (embedding, classification, scoring) asks for.

A ``msgspec.Struct`` that travels inside ``EngineCoreRequest`` in place of ``SamplingParams``; names follow vLLM.
The model's pooler reads them on the engine side: ``dimensions`` truncates a Matryoshka embedding, ``normalize``
L2-normalizes an embedding, ``use_activation`` applies the classifier's activation (softmax, or sigmoid for one
label); ``None`` takes the model's default.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: The pooling tasks, by vLLM's names: one vector per input, or one per token.
POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Parameters of one pooling request (vLLM-compatible names).

    ``task`` is set by the API called (``LLM.embed`` → ``"embed"``); ``truncate_prompt_tokens`` keeps the last
    N prompt tokens (-1: ``max_model_len``); ``dimensions`` keeps the first N embedding dimensions (models trained
    for it); ``step_tag_id`` / ``returned_token_ids`` select the positions and classes of step pooling (process
    reward models). ``activation`` and ``softmax`` are vLLM's older names of ``use_activation``.
    ``extra_kwargs`` carries the engine's own per-request facts, e.g. where the second text of a cross-encoder
    pair starts (``token_type_start``).
    """

    task: str | None = None
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    extra_kwargs: dict[str, Any] | None = None
    # vLLM's older names for use_activation.
    activation: bool | None = None
    softmax: bool | None = None

    def __post_init__(self) -> None:
        for alias in (self.activation, self.softmax):
            if alias is not None and self.use_activation is None:
                self.use_activation = alias
        self.activation = self.softmax = None
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}; got {self.task!r}.")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and truncate < 1 and truncate != -1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate}.")

    def clone(self) -> PoolingParams:
        """A copy whose mutable fields are not shared."""
        return msgspec.structs.replace(
            self,
            returned_token_ids=list(self.returned_token_ids) if self.returned_token_ids is not None else None,
            extra_kwargs=dict(self.extra_kwargs) if self.extra_kwargs is not None else None,
        )

    def with_task(self, task: str) -> PoolingParams:
        """A copy for ``task``; the task the caller set must agree with it."""
        if self.task is not None and self.task != task:
            raise ValueError(f"PoolingParams.task is {self.task!r}, but the call runs task {task!r}.")
        return msgspec.structs.replace(self.clone(), task=task)
