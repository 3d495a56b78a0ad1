"""The pooling routes' request and response shapes, as vLLM serves them: ``/v1/embeddings`` (OpenAI's), ``/pooling``,
``/classify``, ``/score`` and ``/rerank`` (the Jina / Cohere shape).

Requests are pydantic models that reject unknown fields (HTTP 400 naming the field), as the other routes' are;
responses are msgspec structs (an embedding is a long list of floats: encoded straight to JSON).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from pydantic import Field

from vllite.plugins.openai_server.protocol import RequestModel
from vllite.plugins.openai_server.responses import Response, UsageInfo, now

#: One input or several: a text, texts, a token id list, or token id lists (OpenAI's ``input``).
PoolingInput = str | list[str] | list[int] | list[list[int]]

#: The tasks a pooling request may name (vLLM's ``PoolingTask``).
PoolingTask = Literal["embed", "classify", "score", "token_embed", "token_classify"]


class PoolingFields(RequestModel):
    """What every pooling request shares: OpenAI's ``model`` and ``user``, then vLLM's extras."""

    model: str | None = None
    user: str | None = None
    # -1: the model's context length; k >= 1: keep the first k tokens of a text (the tokenizer truncates, as
    # vLLM's does) or the last k of a token id list (as vLLM cuts them)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None


class ActivationFields(PoolingFields):
    """The classification heads' switch: ``use_activation`` (vLLM's; ``activation`` and ``softmax`` are its
    deprecated spellings)."""

    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def activation_flag(self) -> bool | None:
        """The first of ``use_activation``, ``activation``, ``softmax`` that is set."""
        for value in (self.use_activation, self.activation, self.softmax):
            if value is not None:
                return value
        return None


class EmbeddingRequest(PoolingFields):
    """``POST /v1/embeddings``: OpenAI's fields, with vLLM's ``normalize``."""

    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest, ActivationFields):
    """``POST /pooling``: an embedding request naming its task (default: the model's first); ``use_activation``
    for the classification tasks."""

    task: PoolingTask | None = None


class ClassificationRequest(ActivationFields):
    """``POST /classify``."""

    input: PoolingInput


class ScoreRequest(ActivationFields):
    """``POST /score`` and ``/v1/score``: ``text_1`` against each of ``text_2`` (one to many), or pairwise (lists
    of one length)."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankDocumentInput(RequestModel):
    """A document given as an object (``{"text": ...}``, as Cohere's older API and Jina accept)."""

    text: str


class RerankRequest(ActivationFields):
    """``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` (Jina's and Cohere's shape, as vLLM serves it)."""

    query: str
    documents: list[str | RerankDocumentInput]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


# ---------------------------------------------------------------------------------------------- responses


class ListResponse(Response, kw_only=True):
    """vLLM's envelope of a pooling route's answer: the request's id, model and usage around ``data`` (each
    subclass's list)."""

    id: str
    object: str = "list"
    created: int = msgspec.field(default_factory=now)
    model: str
    usage: UsageInfo


class EmbeddingData(Response, kw_only=True):
    """One input's embedding: floats, or base64 of little-endian float32."""

    index: int
    object: str = "embedding"
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format="base64"


class EmbeddingResponse(ListResponse, kw_only=True):
    """``/v1/embeddings``' answer (OpenAI's shape)."""

    data: list[EmbeddingData]


class PoolingData(Response, kw_only=True):
    """One input's pooled tensor as nested lists."""

    index: int
    object: str = "pooling"
    data: Any  # the pooled tensor as nested lists, or base64 of its float32 values


class PoolingResponse(ListResponse, kw_only=True):
    """``/pooling``'s answer."""

    data: list[PoolingData]


class ClassificationData(Response):
    """One input's class probabilities and the most likely label."""

    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(ListResponse, kw_only=True):
    """``/classify``'s answer."""

    data: list[ClassificationData]


class ScoreData(Response, kw_only=True):
    """One pair's relevance score."""

    index: int
    object: str = "score"
    score: float


class ScoreResponse(ListResponse, kw_only=True):
    """``/score``'s answer, one score per pair."""

    data: list[ScoreData]


class RerankDocument(Response):
    """A reranked document's text."""

    text: str


class RerankResult(Response, omit_defaults=True):
    """One document's place in a rerank: its input index and relevance score."""

    index: int
    relevance_score: float
    document: RerankDocument | None = None  # left out with return_documents=false


class RerankUsage(Response):
    """A rerank's token count."""

    prompt_tokens: int
    total_tokens: int


class RerankResponse(Response):
    """``/rerank``'s answer (Jina's and Cohere's shape): the documents, most relevant first."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def pooling_usage(prompt_tokens: int) -> UsageInfo:
    """A pooling response's usage: prompt tokens only."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
