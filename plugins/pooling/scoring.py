"""Scoring inputs and outputs: vLLM's text pairs, a cross-encoder's pair prompt, the cosine scores of embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def score_prompt(tokenizer: Any, text_1: str, text_2: str, max_length: int | None = None) -> dict[str, Any]:
    """A cross-encoder's input for the pair: the tokenizer's pair encoding, with ``token_type_ids`` when the
    tokenizer makes them (BERT-style); truncated to ``max_length`` tokens when given."""
    kwargs: dict[str, Any] = {"truncation": True, "max_length": max_length} if max_length else {}
    encoded = tokenizer(text_1, text_2, **kwargs)
    prompt: dict[str, Any] = {"prompt_token_ids": list(encoded["input_ids"])}
    if encoded.get("token_type_ids") is not None:
        prompt["token_type_ids"] = list(encoded["token_type_ids"])
    return prompt


def pair_up(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's scoring pairs: one-to-one (equal lengths), one-to-many (one ``text_1``), ``ValueError`` otherwise."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("score needs at least one text on each side.")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}; give one text_1, or as many.")
    return list(zip(first, second, strict=True))


def cosine_scores(embeddings_1: Sequence[Any], embeddings_2: Sequence[Any]) -> list[float]:
    """The cosine similarity of each pair of embedding tensors (an embedding model's scores)."""
    import torch

    return [
        float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        for a, b in zip(embeddings_1, embeddings_2, strict=True)
    ]
