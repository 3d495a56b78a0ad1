"""``RequestOutputCollector``: ``AsyncLLM``'s per-request output queue (an ``OutputQueue`` the output processor
fills), one slot that merges DELTA outputs while the consumer lags."""

from __future__ import annotations

import asyncio
from collections import deque

from vllite.outputs import RequestOutput
from vllite.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """A one-slot async queue of a request's outputs that merges DELTA outputs while the consumer lags.

    CUMULATIVE and FINAL_ONLY outputs replace the pending one (the newest is complete); an exception replaces
    it and is raised by the getter. ``keep_turns`` (a session): an output that ends a turn is never merged with
    the next turn's; ended turns wait in order for the consumer.
    """

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, *, keep_turns: bool = False):
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.keep_turns = keep_turns
        self.output: RequestOutput | Exception | None = None
        self.ended_turns: deque[RequestOutput] = deque()
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if self.keep_turns and isinstance(output, RequestOutput) and _ends_turn(output):
            if isinstance(self.output, Exception):
                return
            if isinstance(self.output, RequestOutput):
                merge_request_outputs(self.output, output, aggregate=self.aggregate)
                output = self.output
            self.ended_turns.append(output)
            self.output = None
        elif isinstance(self.output, RequestOutput) and isinstance(output, RequestOutput):
            merge_request_outputs(self.output, output, aggregate=self.aggregate)
        elif not isinstance(self.output, Exception) or isinstance(output, Exception):
            self.output = output
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None and not self.ended_turns:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None and not self.ended_turns else self._take()

    def _take(self) -> RequestOutput:
        if self.ended_turns and not isinstance(self.output, Exception):
            output: RequestOutput | Exception | None = self.ended_turns.popleft()
        else:
            output, self.output = self.output, None
        if self.output is None and not self.ended_turns:
            self.ready.clear()
        if isinstance(output, Exception):
            raise output
        assert output is not None
        return output


def merge_request_outputs(into: RequestOutput, new: RequestOutput, *, aggregate: bool) -> None:
    """Folds ``new`` into ``into``, per sample: appends text, tokens, logprobs (``aggregate``) or replaces."""
    into.finished = into.finished or new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.kv_transfer_params = new.kv_transfer_params or into.kv_transfer_params
    if new.prompt_logprobs:
        into.prompt_logprobs = (into.prompt_logprobs or []) + new.prompt_logprobs if aggregate else new.prompt_logprobs
    for completion in new.outputs:
        position = next((i for i, c in enumerate(into.outputs) if c.index == completion.index), None)
        if position is None:
            into.outputs.append(completion)
        elif not aggregate:
            into.outputs[position] = completion
        else:
            old = into.outputs[position]
            old.text += completion.text
            old.token_ids = old.token_ids + completion.token_ids
            if completion.logprobs is not None:
                old.logprobs = (old.logprobs or []) + completion.logprobs
            old.cumulative_logprob = completion.cumulative_logprob
            old.finish_reason, old.stop_reason = completion.finish_reason, completion.stop_reason
    into.outputs.sort(key=lambda c: c.index)


def _ends_turn(output: RequestOutput) -> bool:
    """Whether ``output`` ends a session's turn: a finish reason on an output that is not the last."""
    return not output.finished and any(c.finish_reason is not None for c in output.outputs)
