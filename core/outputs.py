"""What ``LLM.generate`` returns: ``RequestOutput`` holding one ``CompletionOutput`` per sample (vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# One position's logprobs: token id -> Logprob.
SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass
class Logprob:
    """The log probability of one token, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``index`` is the sample number when ``n > 1``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With ``finish_reason == "error"``: what failed (the plugin, the hook and the exception, or the check).
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one request so far: the prompt, its samples and whether it has finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
