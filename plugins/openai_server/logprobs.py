"""vllite's per-position logprob dicts in OpenAI's two shapes (legacy completions and chat), and in vLLM's
``prompt_logprobs`` shape.

With ``return_tokens_as_token_ids`` (vLLM's field) every token is written ``"token_id:N"`` instead of its text, so
tokens that are not valid UTF-8 on their own (a byte of a multi-byte character) stay identifiable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from vllite.outputs import Logprob, PromptLogprobs
from vllite.plugins.openai_server.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    Response,
    TokenLogprob,
    TopLogprob,
)

#: What OpenAI-style responses write for a logprob of -inf (JSON has no infinity), as vLLM clamps it.
MIN_LOGPROB = -9999.0


class PromptLogprob(Response):
    """One token of one prompt position in vLLM's ``prompt_logprobs`` (its ``Logprob`` as JSON)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


#: vLLM's ``prompt_logprobs``: per prompt position, ``{token_id: PromptLogprob}``; ``None`` for the first token.
PromptLogprobsJSON = list[dict[int, PromptLogprob] | None]


def prompt_logprobs_json(positions: PromptLogprobs | None) -> PromptLogprobsJSON | None:
    """The engine's prompt logprobs in vLLM's response shape (token ids as keys; -inf clamped to -9999)."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            token_id: PromptLogprob(_finite(entry.logprob), entry.rank, entry.decoded_token)
            for token_id, entry in position.items()
        }
        for position in positions
    ]


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB


def _token_text(token_id: int, entry: Logprob | None, tokenizer: Any, as_token_id: bool = False) -> str:
    if as_token_id:
        return f"token_id:{token_id}"
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    if tokenizer is not None:
        return tokenizer.decode([token_id])
    return f"token_id:{token_id}"


def _top(position: dict[int, Logprob], num: int, only: Sequence[int] | None = None) -> list[tuple[int, Logprob]]:
    """The ``num`` most likely tokens at one position (rank 1 first), or the ``only`` ids a request scored
    (``logprob_token_ids``), in its order."""
    if only:
        return [(t, position[t]) for t in only if t in position]
    ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
    return [item for item in ranked if item[1].rank is not None and item[1].rank <= num][:num]


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[dict[int, Logprob] | None],
    num: int,
    tokenizer: Any,
    *,
    text_offset: int = 0,
    as_token_ids: bool = False,
    only: Sequence[int] | None = None,
) -> CompletionLogprobs:
    """Legacy completions logprobs of ``token_ids`` (``positions[i]`` holds token i's logprobs; ``None`` for
    an echoed first prompt token, which has none); offsets start at ``text_offset`` characters. Each position's
    ``top_logprobs`` lists its own token first, then the top ``num`` (vLLM's order). ``as_token_ids``:
    tokens as ``"token_id:N"``; ``only``: the ``logprob_token_ids`` to list instead of the top ``num``."""
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    offset = text_offset
    for token_id, position in zip(token_ids, positions):
        entry = position.get(token_id) if position is not None else None
        text = _token_text(token_id, entry, tokenizer, as_token_ids)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if position is None or entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(max(entry.logprob, -9999.0))
        top = {text: max(entry.logprob, -9999.0)}  # vLLM's order: the position's own token first, then the top
        for t, lp in _top(position, num, only):
            top.setdefault(_token_text(t, lp, tokenizer, as_token_ids), max(lp.logprob, -9999.0))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[dict[int, Logprob]],
    num: int,
    tokenizer: Any,
    *,
    as_token_ids: bool = False,
    only: Sequence[int] | None = None,
) -> ChatLogprobs:
    """Chat logprobs: each sampled token with its logprob and its ``num`` top alternatives (``as_token_ids``:
    tokens as ``"token_id:N"``; ``only``: the ``logprob_token_ids`` to list instead)."""
    content = []
    for token_id, position in zip(token_ids, positions):
        entry = position.get(token_id)
        text = _token_text(token_id, entry, tokenizer, as_token_ids)
        logprob = max(entry.logprob, -9999.0) if entry is not None else -9999.0
        top = [
            TopLogprob(
                token=(top_text := _token_text(t, lp, tokenizer, as_token_ids)),
                logprob=max(lp.logprob, -9999.0),
                bytes=list(top_text.encode("utf-8", errors="replace")),
            )
            for t, lp in _top(position, num, only)
        ]
        content.append(
            TokenLogprob(
                token=text, logprob=logprob, bytes=list(text.encode("utf-8", errors="replace")), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)
