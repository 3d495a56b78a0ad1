"""One streamed request of ``vllite bench serve`` and what it measured.

:func:`stream_request` posts a streaming ``/v1/completions`` or ``/v1/chat/completions`` body on an aiohttp session
and times it: TTFT is the arrival of the first chunk that carries a token (non-empty text or token ids), ITL the
gaps between such chunks, E2E latency the time to ``data: [DONE]``. Output tokens come from the final ``usage``
(``stream_options.include_usage``), else from the streamed ``token_ids`` (``return_token_ids``), else one per token
chunk. A failure (HTTP error, an ``error`` event, a broken or token-less stream, a network error) is returned as a
:class:`RequestResult` with ``success=False`` and the error's text, never raised. aiohttp is imported by the caller.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp


@dataclass
class RequestResult:
    """What one request measured (seconds); ``output_tokens`` and ``prompt_tokens`` in tokens."""

    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    start: float = 0.0  # perf_counter() when the request was sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (latency - TTFT) / (output tokens - 1); None for < 2 tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class SSEDecoder:
    """Splits a server-sent-events byte stream into the payloads of its ``data:`` lines.

    Bytes may arrive cut anywhere (inside a line, inside a UTF-8 character); ``feed`` returns the payloads of the
    lines completed so far. Comment lines (``: ...``), other fields and blank separators are dropped; the payloads
    of the multi-line events this client meets are one line each (OpenAI, vLLM and vllite all send one).
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        """The ``data:`` payloads of the lines that ``data`` completes."""
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return [payload for line in lines if (payload := _data_payload(line)) is not None]

    def flush(self) -> list[str]:
        """The payload of an unterminated last line, if any."""
        line, self._buffer = self._buffer, b""
        payload = _data_payload(line)
        return [payload] if payload is not None else []


def _data_payload(line: bytes) -> str | None:
    text = line.decode("utf-8").rstrip("\r")
    if not text.startswith("data:"):
        return None
    payload = text[5:]
    return payload[1:] if payload.startswith(" ") else payload


def _chunk_tokens(choice: dict[str, Any], chat: bool) -> tuple[bool, int | None]:
    """Whether a streamed choice carries output, and its token count when it says (``token_ids``)."""
    token_ids = choice.get("token_ids")
    if chat:
        delta = choice.get("delta") or {}
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
        has_text = bool(text) or bool(delta.get("tool_calls"))
    else:
        has_text = bool(choice.get("text"))
    count = len(token_ids) if isinstance(token_ids, list) else None
    return has_text or bool(count), count


async def stream_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], *, chat: bool = False
) -> RequestResult:
    """Posts ``body`` (which must ask for ``stream: true``) to ``url`` and measures it; never raises on failure."""
    result = RequestResult(start=time.perf_counter())
    try:
        await _stream(session, url, body, chat, result)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # network errors, malformed JSON, ...: a failed request, not a crashed run
        result.success, result.error = False, f"{type(exc).__name__}: {exc}"
    return result


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], chat: bool, result: RequestResult
) -> None:
    start = result.start
    last = start
    counted_tokens, token_chunks, usage_tokens = 0, 0, None
    done = False
    async with session.post(url, json=body) as response:
        if response.status != 200:
            text = await response.text()
            result.error = f"HTTP {response.status}: {text[:500]}"
            return
        decoder = SSEDecoder()
        async for data in response.content.iter_any():
            now = time.perf_counter()
            for payload in decoder.feed(data):
                if payload.strip() == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    result.error = f"error event: {message}"
                    return
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                has_token, count = _chunk_tokens(choices[0], chat)
                if not has_token:
                    continue
                if token_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                token_chunks += 1
                counted_tokens += count if count is not None else 1
        done = done or any(p.strip() == "[DONE]" for p in decoder.flush())
        result.latency = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else counted_tokens
    if not done:
        result.error = "the stream ended before data: [DONE]"
    elif token_chunks == 0:
        result.error = "the stream carried no token"
    else:
        result.success = True
