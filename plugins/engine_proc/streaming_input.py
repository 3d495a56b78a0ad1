"""``AsyncLLM.generate`` with streaming input: a session fed by an async iterable of ``StreamingInput``.

The first chunk starts the session (a resumable request); a feeder task sends each later chunk as it comes, and the
end of the iterable ends the session's input. The consumer gets every turn's outputs, each turn ending with its
finish reason and ``finished`` False, then one last output with ``finished`` True. Closing or cancelling the stream
aborts the session (its KV is freed); a failing input iterable or a bad chunk ends the stream with that error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING, Any

from vllite.engine.sessions import StreamingInput
from vllite.exceptions import SessionClosedError
from vllite.outputs import RequestOutput
from vllite.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllite.lora import LoRARequest
    from vllite.plugins.engine_proc.async_llm import AsyncLLM


async def stream_session(
    llm: AsyncLLM,
    inputs: AsyncIterable[StreamingInput],
    sampling_params: SamplingParams | None,
    request_id: str,
    *,
    priority: int = 0,
    data_parallel_rank: int | None = None,
    lora_request: LoRARequest | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """Runs one session over ``inputs`` and yields its outputs (see the module docstring). A chunk without sampling
    parameters uses the previous turn's; the first falls back to ``sampling_params``."""
    iterator = aiter(inputs)
    try:
        first = _check_chunk(await anext(iterator))
    except StopAsyncIteration:
        raise ValueError("The session's input stream ended before its first chunk.") from None
    queue, engine_ids = await llm._submit(
        request_id,
        first.prompt,
        first.sampling_params or sampling_params,
        priority=priority,
        data_parallel_rank=data_parallel_rank,
        lora_request=lora_request,
        resumable=True,
    )
    engine_id = engine_ids[0]
    feeder = asyncio.create_task(_feed(llm, iterator, engine_id, queue), name=f"vllite-session-input-{request_id}")
    try:
        async with contextlib.aclosing(llm._outputs(queue, engine_id)) as outputs:
            async for output in outputs:
                yield output
    finally:
        if not feeder.done():
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder


async def _feed(llm: AsyncLLM, iterator: AsyncIterator[StreamingInput], engine_id: str, queue: Any) -> None:
    """Sends the session's later chunks, then the end of its input. A failure ends the session: the error goes to
    its stream and the session is aborted in the engine."""
    frontend, engine_core = llm.frontend, llm.engine_core
    try:
        async for chunk in iterator:
            chunk = _check_chunk(chunk)
            await engine_core.add_request_async(
                frontend.prepare_session_chunk(engine_id, chunk.prompt, chunk.sampling_params)
            )
        await engine_core.add_request_async(frontend.prepare_session_chunk(engine_id, None))
    except SessionClosedError:
        return  # the session already ended (aborted, failed, or its engine died): its stream says why
    except Exception as exc:
        queue.put(exc)
        llm._abort_now([engine_id])


def _check_chunk(chunk: object) -> StreamingInput:
    if not isinstance(chunk, StreamingInput):
        raise TypeError(f"A session's input stream must yield StreamingInput chunks, got {type(chunk).__name__}.")
    return chunk
