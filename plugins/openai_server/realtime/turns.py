"""One realtime response (a turn of the engine session): its ids, the text it has streamed, and the server events
that open it, stream it and close it (GA shapes: one assistant message with one text part)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllite.plugins.openai_server.realtime.protocol import message_item, response_object, server_event


@dataclass
class Turn:
    """The response in progress: its ids, what it has generated, and whether the client cancelled it (a cancelled
    turn streams nothing more; the engine finishes it)."""

    response_id: str
    item_id: str
    previous_item_id: str | None
    conversation_id: str
    max_output_tokens: int | str
    metadata: dict[str, str] | None
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    cancelled: bool = False

    def opening_events(self) -> list[dict[str, Any]]:
        """``response.created``, the assistant item added (to the response and to the conversation), its text part."""
        item = message_item(self.item_id, "assistant", [], "in_progress")
        return [
            server_event("response.created", response=self._response("in_progress")),
            server_event("response.output_item.added", response_id=self.response_id, output_index=0, item=item),
            server_event("conversation.item.added", previous_item_id=self.previous_item_id, item=item),
            self._part_event("response.content_part.added", part={"type": "text", "text": ""}),
        ]

    def delta_event(self, delta: str) -> dict[str, Any]:
        """``response.output_text.delta``."""
        return self._part_event("response.output_text.delta", delta=delta)

    def closing_events(
        self, status: str, details: dict[str, Any] | None, usage: dict[str, Any] | None
    ) -> list[dict[str, Any]]:
        """The text, part, item and conversation item done, then ``response.done`` (last) with ``status``, its
        ``status_details`` and ``usage``. The item holds all the text the turn generated: it is in the session's
        context, streamed or not."""
        text = "".join(self.text)
        item_status = "completed" if status == "completed" else "incomplete"
        item = message_item(self.item_id, "assistant", [{"type": "output_text", "text": text}], item_status)
        done = self._response(status, output=[item], status_details=details, usage=usage)
        return [
            self._part_event("response.output_text.done", text=text),
            self._part_event("response.content_part.done", part={"type": "text", "text": text}),
            server_event("response.output_item.done", response_id=self.response_id, output_index=0, item=item),
            server_event("conversation.item.done", previous_item_id=self.previous_item_id, item=item),
            server_event("response.done", response=done),
        ]

    def _part_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return server_event(
            kind, response_id=self.response_id, item_id=self.item_id, output_index=0, content_index=0, **fields
        )

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return response_object(
            self.response_id,
            self.conversation_id,
            status,
            max_output_tokens=self.max_output_tokens,
            metadata=self.metadata,
            **fields,
        )
