"""What ``LLM.generate`` returns: ``RequestOutput`` holding one ``CompletionOutput`` per sample (vLLM names); the
results of pooling (``PoolingRequestOutput`` and its task views) and of ``LLM.beam_search`` (``BeamSearchOutput``)."""

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
    # --enable-return-routed-experts, once finished: int16 [positions, moe_layers, top_k] top-k expert ids of every
    # computed position (the prompt and every generated token but the last; -1 where a window released it).
    routed_experts: Any = None

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


@dataclass
class BeamSearchSequence:
    """One beam of ``LLM.beam_search``: ``tokens`` is the prompt followed by the generated tokens (vLLM's shape),
    ``logprobs`` the top logprobs of each generated position, ``text`` filled once the sequence is returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best sequences of one prompt, best first, at most ``beam_width`` of them."""

    sequences: list[BeamSearchSequence]


@dataclass
class PoolingOutput:
    """What a pooling model returns for one input: a float32 tensor (a vector, or one row per token)."""

    data: Any


@dataclass
class PoolingRequestOutput:
    """The finished output of one pooling request; ``outputs`` is a :class:`PoolingOutput` or a typed view."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    error: str | None = None  # why the request failed (``outputs.data`` is then None)

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> Any:
        """The typed view (``EmbeddingRequestOutput`` and the others) of a plain pooling output."""
        view: Any = getattr(cls, "_view", None)
        outputs = view.from_base(output.outputs) if view is not None else output.outputs
        return cls(output.request_id, outputs, output.prompt_token_ids, output.finished, output.num_cached_tokens)


@dataclass
class EmbeddingOutput:
    """One input's embedding vector."""

    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        if output.data.dim() != 1:
            raise ValueError(f"an embedding is one vector; this output has shape {list(output.data.shape)}.")
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """One input's class probabilities (or raw scores, with ``use_activation=False``)."""

    probs: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ClassificationOutput:
        if output.data.dim() != 1:
            raise ValueError(f"class probabilities are one vector; this output has shape {list(output.data.shape)}.")
        return cls(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """The relevance score of one text pair."""

    score: float

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ScoringOutput:
        if output.data.numel() != 1:
            raise ValueError(f"a score is one number; this output has shape {list(output.data.shape)}.")
        return cls(float(output.data.reshape(()).item()))


class EmbeddingRequestOutput(PoolingRequestOutput):
    """``LLM.embed``'s output: ``outputs.embedding``."""

    _view = EmbeddingOutput


class ClassificationRequestOutput(PoolingRequestOutput):
    """``LLM.classify``'s output: ``outputs.probs``."""

    _view = ClassificationOutput


class ScoringRequestOutput(PoolingRequestOutput):
    """``LLM.score``'s output: ``outputs.score``."""

    _view = ScoringOutput
