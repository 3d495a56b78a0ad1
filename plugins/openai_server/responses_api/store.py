"""The server's memory of its responses (``store: true``, the default): what ``GET /v1/responses/{id}`` returns and
what ``previous_response_id`` continues from. In memory, per server, bounded: the least recently used response goes
first once :data:`MAX_STORED_RESPONSES` are kept. A restart forgets them all.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllite.plugins.openai_server.http_errors import ResponseNotFoundError
from vllite.plugins.openai_server.responses_api.protocol import ResponseObject

#: How many responses one server keeps.
MAX_STORED_RESPONSES = 1000


@dataclass
class StoredResponse:
    """A response and the conversation it ends: its input items (the previous responses' included) and its output
    items, as input items a next request continues from. ``task`` runs a background response until it finishes."""

    response: ResponseObject
    items: list[Any] = field(default_factory=list)
    task: asyncio.Task | None = None


class ResponseStore:
    """Stored responses by id, least recently used first out."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}.")
        self.capacity = capacity
        self.running: set[asyncio.Task] = set()  # the background responses' tasks
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def put(self, entry: StoredResponse) -> None:
        """Stores (or replaces) ``entry`` under its response's id; forgets the least recently used beyond capacity."""
        response_id = entry.response.id
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored entry (now the most recently used); :class:`ResponseNotFoundError` naming ``param`` if none."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> StoredResponse:
        """Forgets a response (cancelling it first if it still runs in the background)."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            raise ResponseNotFoundError(response_id)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
        return entry
