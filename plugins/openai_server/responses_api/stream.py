"""A reply as Responses output items, whole or streamed as OpenAI's server-sent events.

:class:`OutputBuilder` takes the reply's parts in order (reasoning, text, function calls, as the reasoning and tool
parsers split them off) and builds the output items; each item is announced by the events the ``openai`` client
accumulates: ``response.output_item.added``, ``response.content_part.added``, the deltas
(``response.reasoning_text.delta``, ``response.output_text.delta``, ``response.function_call_arguments.delta``), their
``.done`` events, ``response.content_part.done`` and ``response.output_item.done``. A whole response is built by the
same builder, so the streamed items add up to the whole one's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from vllite.plugins.openai_server.errors import check_sample, classify
from vllite.plugins.openai_server.protocol import random_id
from vllite.plugins.openai_server.responses import encode
from vllite.plugins.openai_server.responses_api.protocol import (
    FunctionCallOutput,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningOutput,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
)

Event = tuple[str, dict[str, Any]]


@dataclass
class _Open:
    """The item being built: its kind, id, place in ``output``, text so far, and a call's id and name."""

    kind: str
    id: str
    index: int
    parts: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class OutputBuilder:
    """The output items of one reply, built from its parts as they come, and the events announcing them."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self.events: list[Event] = []
        self._open: _Open | None = None

    def take_events(self) -> list[Event]:
        """The events since the last call."""
        events, self.events = self.events, []
        return events

    def reasoning(self, text: str) -> None:
        """More of the reply's reasoning."""
        if not text:
            return
        item = self._ensure("reasoning", "rs_")
        item.parts.append(text)
        self._emit("response.reasoning_text.delta", item, content_index=0, delta=text)

    def text(self, text: str) -> None:
        """More of the reply's text (its answer)."""
        if not text:
            return
        item = self._ensure("message", "msg_")
        item.parts.append(text)
        self._emit("response.output_text.delta", item, content_index=0, delta=text, logprobs=[])

    def call(self, call_id: str | None, name: str | None, arguments: str) -> None:
        """A function call: a new one (``call_id`` given), or more arguments of the current one."""
        item = self._open
        if call_id is not None or item is None or item.kind != "function_call":
            item = self._start("function_call", "fc_", call_id=call_id or random_id("call_"), name=name or "")
        if arguments:
            item.parts.append(arguments)
            self._emit("response.function_call_arguments.delta", item, delta=arguments)

    def finish(self, incomplete: bool = False) -> list[OutputItem]:
        """Closes the reply; a reply with neither text nor calls still has a (maybe empty) message. ``incomplete``:
        the reply was cut (``max_output_tokens``), and its last item is marked so."""
        status = "incomplete" if incomplete else "completed"
        answered = any(isinstance(item, (OutputMessage, FunctionCallOutput)) for item in self.items)
        if not answered and (self._open is None or self._open.kind == "reasoning"):
            self._ensure("message", "msg_")
        self._close(status)
        return self.items

    def _ensure(self, kind: str, prefix: str) -> _Open:
        if self._open is not None and self._open.kind == kind:
            return self._open
        return self._start(kind, prefix)

    def _start(self, kind: str, prefix: str, call_id: str = "", name: str = "") -> _Open:
        self._close("completed")
        item = _Open(kind, random_id(prefix), len(self.items), call_id=call_id, name=name)
        self._open = item
        added: OutputItem
        if kind == "reasoning":
            added = ReasoningOutput(id=item.id, content=[], status="in_progress")
        elif kind == "message":
            added = OutputMessage(id=item.id, content=[], status="in_progress")
        else:
            added = FunctionCallOutput(id=item.id, call_id=call_id, name=name, arguments="", status="in_progress")
        self.events.append(("response.output_item.added", {"output_index": item.index, "item": added}))
        if kind == "reasoning":
            self._emit("response.content_part.added", item, content_index=0, part=ReasoningText(""))
        elif kind == "message":
            self._emit("response.content_part.added", item, content_index=0, part=OutputText(""))
        return item

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        text = "".join(item.parts)
        done: OutputItem
        if item.kind == "reasoning":
            part = ReasoningText(text)
            self._emit("response.reasoning_text.done", item, content_index=0, text=text)
            self._emit("response.content_part.done", item, content_index=0, part=part)
            done = ReasoningOutput(id=item.id, content=[part], status=status)
        elif item.kind == "message":
            message_part = OutputText(text)
            self._emit("response.output_text.done", item, content_index=0, text=text, logprobs=[])
            self._emit("response.content_part.done", item, content_index=0, part=message_part)
            done = OutputMessage(id=item.id, content=[message_part], status=status)
        else:
            self._emit("response.function_call_arguments.done", item, arguments=text)
            done = FunctionCallOutput(id=item.id, call_id=item.call_id, name=item.name, arguments=text, status=status)
        self.items.append(done)
        self.events.append(("response.output_item.done", {"output_index": item.index, "item": done}))

    def _emit(self, kind: str, item: _Open, **payload: Any) -> None:
        self.events.append((kind, {"item_id": item.id, "output_index": item.index, **payload}))


def apply_delta(builder: OutputBuilder, delta: Any) -> None:
    """Feeds one chat stream delta (a ``DeltaMessage`` of the reasoning / tool extractors) to ``builder``."""
    if delta.reasoning_content:
        builder.reasoning(delta.reasoning_content)
    if delta.content:
        builder.text(delta.content)
    for call in delta.tool_calls or ():
        function = call.function
        name = function.name if function is not None else None
        builder.call(call.id, name, (function.arguments if function is not None else None) or "")


class EventWriter:
    """Server-sent events with OpenAI's ``event:`` line and consecutive ``sequence_number``\\ s."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def write(self, kind: str, payload: dict[str, Any]) -> bytes:
        """One event of type ``kind``."""
        body = {"type": kind, **payload, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode(body) + b"\n\n"

    def lifecycle(self, kind: str, response: ResponseObject) -> bytes:
        """``response.created``, ``.in_progress``, ``.completed``, ``.incomplete`` or ``.failed``."""
        return self.write(kind, {"response": response})

    def error(self, exc: BaseException) -> bytes:
        """An ``error`` event for a failure after the stream began."""
        status, body = classify(exc)
        code = "server_error" if status >= 500 else "invalid_request"
        return self.write("error", {"code": code, "message": body.error.message, "param": body.error.param})


def make_usage(prompt_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int) -> ResponseUsage:
    """The response's ``usage``."""
    return ResponseUsage(
        input_tokens=prompt_tokens,
        output_tokens=output_tokens,
        total_tokens=prompt_tokens + output_tokens,
        input_tokens_details={"cached_tokens": cached, "cache_write_tokens": 0},
        output_tokens_details={"reasoning_tokens": reasoning_tokens},
    )


def count_reasoning_tokens(tokenizer: Any, parser: Any, token_ids: list[int], items: list[OutputItem]) -> int:
    """How many of the reply's tokens were reasoning: up to the end of the parser's end marker when the reply holds
    its tokens, all of them when the reply is nothing but reasoning, else the reasoning text's tokens."""
    texts = [part.text for item in items if isinstance(item, ReasoningOutput) for part in item.content]
    if parser is None or not any(texts) or tokenizer is None:
        return 0
    marker = list(tokenizer.encode(parser.end_marker, add_special_tokens=False)) if parser.end_marker else []
    for start in range(len(token_ids) - len(marker) + 1 if marker else 0):
        if token_ids[start : start + len(marker)] == marker:
            return start + len(marker)
    answered = any(isinstance(item, FunctionCallOutput) for item in items) or any(
        part.text for item in items if isinstance(item, OutputMessage) for part in item.content
    )
    if not answered:
        return len(token_ids)
    return len(tokenizer.encode("".join(texts), add_special_tokens=False))


@dataclass
class StreamParts:
    """What a stream needs from its route: the reply's extractor (``feed`` / ``finish``, from the reasoning and tool
    modes), how to snapshot the response, and what to do with the finished one (store it)."""

    extractor: Any
    snapshot: Callable[..., ResponseObject]
    finished: Callable[[list[OutputItem], list[int], Any], ResponseObject]


async def stream_events(parts: StreamParts, outputs: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[bytes]:
    """The response's events from the engine's step outputs: created, in progress, the items' events, and
    ``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``); a failure after the first
    event ends the stream with an ``error`` event and ``response.failed``."""
    writer, builder = EventWriter(), OutputBuilder()
    token_ids: list[int] = []
    yield writer.lifecycle("response.created", parts.snapshot("in_progress"))
    yield writer.lifecycle("response.in_progress", parts.snapshot("in_progress"))
    try:
        final = None
        async for _, output in outputs:
            final = output
            sample = output.outputs[0]
            check_sample(sample)
            token_ids.extend(sample.token_ids)
            deltas = parts.extractor.feed(sample.text)
            if sample.finish_reason is not None:
                deltas.extend(parts.extractor.finish()[0])
            for delta in deltas:
                apply_delta(builder, delta)
            for kind, payload in builder.take_events():
                yield writer.write(kind, payload)
        assert final is not None
        finish_reason = final.outputs[0].finish_reason
        items = builder.finish(incomplete=finish_reason == "length")
        for kind, payload in builder.take_events():
            yield writer.write(kind, payload)
        response = parts.finished(items, token_ids, final)
        done = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield writer.lifecycle(done, response)
    except Exception as exc:
        yield writer.error(exc)
        failed = parts.snapshot("failed", output=builder.items)
        failed.error = {"code": "server_error", "message": str(exc)}
        yield writer.lifecycle("response.failed", failed)
