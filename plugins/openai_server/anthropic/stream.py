"""A streamed ``/v1/messages`` reply as Anthropic's events.

``message_start`` (the message without content, with the prompt's usage) and a ``ping``; then, per content block,
``content_block_start``, its deltas (``thinking_delta``, ``text_delta``, ``input_json_delta``) and
``content_block_stop``; then ``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage.output_tokens``) and
``message_stop``. The reply is read as the chat route reads it (its reasoning split first, then its tool calls), and
each chat delta becomes events: a change of kind (thinking, text, a new tool call) closes the open block and opens
the next. A failure after the first event ends the stream with an ``error`` event, which the ``anthropic`` client
raises.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from vllite.outputs import RequestOutput
from vllite.plugins.openai_server.anthropic.protocol import Message, Usage, error_body, event, stop_reason_of
from vllite.plugins.openai_server.errors import classify
from vllite.plugins.openai_server.responses import DeltaMessage, DeltaToolCall

if TYPE_CHECKING:
    from vllite.plugins.openai_server.chat import ChatRun


async def stream_message(run: ChatRun) -> AsyncIterator[bytes]:
    """The events of ``run``'s reply (one sample); aborts the engine request if the stream ends early."""
    extractor = run.reasoning.wrap(run.mode.stream())
    blocks = BlockEvents()
    output_tokens = 0
    started = False
    try:
        async for _, output in run.submitted.outputs():
            if not started:
                started = True
                yield _message_start(run, output)
            sample = output.outputs[0]
            if sample.finish_reason == "error":
                yield _error_event(500, f"The request failed in the engine: {sample.error or 'unknown error'}")
                return
            output_tokens += len(sample.token_ids)
            deltas = extractor.feed(sample.text)
            calls: list[DeltaToolCall] = []
            if sample.finish_reason is not None:
                more, calls = extractor.finish()
                deltas.extend(more)
            for delta in deltas:
                for item in blocks.add(delta):
                    yield item
            if sample.finish_reason is not None:
                for item in blocks.close():
                    yield item
                stop_reason, stop_sequence = stop_reason_of(
                    sample.finish_reason, sample.stop_reason, bool(calls) or blocks.called
                )
                delta_body = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
                yield event("message_delta", {"delta": delta_body, "usage": {"output_tokens": output_tokens}})
                yield event("message_stop", {})
    except Exception as exc:
        status, body = classify(exc)
        yield _error_event(status, body.error.message)
    finally:
        await run.submitted.abort_unfinished()


def _message_start(run: ChatRun, output: RequestOutput) -> bytes:
    cached = output.num_cached_tokens
    usage = Usage(input_tokens=len(run.prompt_ids) - cached, output_tokens=0, cache_read_input_tokens=cached)
    message = Message(id=run.request_id, model=run.model, content=[], stop_reason=None, stop_sequence=None, usage=usage)
    return event("message_start", {"message": message}) + event("ping", {})


def _error_event(status: int, message: str) -> bytes:
    return event("error", {"error": error_body(status, message).error})


class BlockEvents:
    """Turns a reply's chat deltas into content-block events, numbering the blocks."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: Any = None  # the open block: "thinking", "text", ("tool_use", call index) or None
        self.called = False  # a tool_use block was sent

    def add(self, delta: DeltaMessage) -> list[bytes]:
        """The events of one chat delta."""
        events: list[bytes] = []
        if delta.reasoning_content:
            events += self._text("thinking", delta.reasoning_content)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.tool_calls or ():
            events += self._call(call)
        return events

    def close(self) -> list[bytes]:
        """``content_block_stop`` for the open block, if any."""
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"index": self.index})]

    def _text(self, kind: str, text: str) -> list[bytes]:
        """A thinking or text delta, opening a block of that ``kind`` first if another is open."""
        events: list[bytes] = []
        if self.kind != kind:
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            events = self._open(kind, block)
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        return events

    def _call(self, call: DeltaToolCall) -> list[bytes]:
        events: list[bytes] = []
        function = call.function
        if self.kind != ("tool_use", call.index):
            self.called = True
            name = function.name if function is not None else None
            block = {"type": "tool_use", "id": call.id or "", "name": name or "", "input": {}}
            events = self._open(("tool_use", call.index), block)
        arguments = function.arguments if function is not None else None
        if arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            events.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        return events

    def _open(self, kind: Any, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.index += 1
        self.kind = kind
        events.append(event("content_block_start", {"index": self.index, "content_block": block}))
        return events
