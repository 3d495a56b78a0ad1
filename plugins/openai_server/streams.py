"""Submitting a route's prompts to ``AsyncLLM`` and reading their outputs, with the server's abort guarantees.

Every prompt of a request is validated and submitted before any output is read, so a bad prompt is a 400 with
nothing left running (the prompts already submitted are aborted). Reading stops early — the client went away,
the route failed — and the requests not yet finished are aborted in the engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from vllite.outputs import RequestOutput
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.sampling import field_named_in
from vllite.sampling_params import SamplingParams

logger = logging.getLogger("vllite.server")


class Submitted:
    """The requests of one route call: ``(request_id, output collector)`` per prompt, in prompt order."""

    def __init__(self, engine: Any, requests: list[tuple[str, Any]]) -> None:
        self.engine = engine
        self.requests = requests
        self.unfinished = {request_id for request_id, _ in requests}

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(prompt index, output)`` as they come, from all prompts, until every one has finished."""
        if len(self.requests) == 1:
            request_id, queue = self.requests[0]
            while request_id in self.unfinished:
                output = queue.get_nowait() or await queue.get()
                if output.finished:
                    self.unfinished.discard(request_id)
                yield 0, output
            return
        ready: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(index: int, request_id: str, queue: Any) -> None:
            try:
                while True:
                    output = queue.get_nowait() or await queue.get()
                    await ready.put((index, output))
                    if output.finished:
                        return
            except Exception as exc:  # the request failed (engine dead, processing error): hand it on
                await ready.put((index, exc))

        tasks = [asyncio.ensure_future(pump(i, rid, q)) for i, (rid, q) in enumerate(self.requests)]
        try:
            while self.unfinished:
                index, item = await ready.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self.unfinished.discard(self.requests[index][0])
                yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def abort_unfinished(self) -> None:
        """Aborts every request that has not finished (idempotent; never suspends, so it runs to the end in a
        task being cancelled)."""
        if self.unfinished:
            request_ids, self.unfinished = sorted(self.unfinished), set()
            logger.info("Aborted request(s) %s: the response ended before they finished", ", ".join(request_ids))
            with contextlib.suppress(Exception):
                await self.engine.abort(request_ids)


async def submit(
    engine: Any,
    request_id: str,
    prompts: Sequence[Any],
    params: SamplingParams,
    *,
    priority: int = 0,
    data_parallel_rank: int | None = None,
    lora_request: Any = None,
    cache_salt: str | None = None,
) -> Submitted:
    """Submits each prompt as ``{request_id}-{index}`` (to the data-parallel engine ``data_parallel_rank`` when
    given, with the LoRA adapter ``lora_request`` when given, in the prefix-cache namespace ``cache_salt`` when
    given); raises :class:`BadRequestError` (nothing left running) when the engine's frontend rejects one."""
    submitted: list[tuple[str, Any]] = []
    try:
        for index, prompt in enumerate(prompts):
            prompt_id = f"{request_id}-{index}"
            queue = await engine.add_request(
                prompt_id,
                salted(prompt, cache_salt),
                params,
                priority=priority,
                data_parallel_rank=data_parallel_rank,
                lora_request=lora_request,
            )
            submitted.append((prompt_id, queue))
    except BaseException as exc:
        await Submitted(engine, submitted).abort_unfinished()
        if isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, BadRequestError):
            raise BadRequestError(str(exc), param=_param_of(str(exc), data_parallel_rank)) from None
        raise
    return Submitted(engine, submitted)


def salted(prompt: Any, cache_salt: str | None) -> Any:
    """``prompt`` as the engine's dict prompt carrying ``cache_salt`` (vLLM's ``TokensPrompt``/``TextPrompt`` field),
    or unchanged without a salt."""
    if cache_salt is None:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": cache_salt}
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": cache_salt}
    return {"prompt_token_ids": list(prompt), "cache_salt": cache_salt}


def _param_of(message: str, data_parallel_rank: int | None = None) -> str | None:
    """The request field an engine-side rejection names: the header or ``vllm_xargs`` for a data-parallel rank
    out of range, the ``SamplingParams`` field its message names (``allowed_token_ids``, ``logprob_token_ids``, ...),
    else ``prompt`` or ``logprobs`` from the message."""
    lowered = message.lower()
    if "data_parallel_rank" in lowered:
        from vllite.plugins.openai_server.http_common import DP_RANK_HEADER

        return DP_RANK_HEADER if data_parallel_rank is not None else "vllm_xargs"
    named = field_named_in(message) if "SamplingParams." in message else None
    if named is not None:
        return named
    if "prompt" in lowered:
        return "prompt"
    if "logprobs" in lowered:
        return "logprobs"
    return None
