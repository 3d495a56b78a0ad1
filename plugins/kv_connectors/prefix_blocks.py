"""The scheduler-side bookkeeping of a connector that keeps full prompt blocks in a store, each under the hash
chain of the prompt prefix that ends with it (``shared-storage``: files; ``offload``: a host-memory tier).

A connector holds one :class:`PrefixBlockTracker` and tells it how to ask its store whether a name is held; the
tracker knows, per live request, the names of its full prompt blocks, the paged-cache blocks they sit in, the
local prefix hit, a pending load and how far its blocks were saved. When the connector loads (synchronously or
not), what its metadata looks like and where the store's knowledge comes from stay the connector's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllite.kv_cache.hashing import (
    generate_block_hash_extra_keys,
    hash_block_tokens,
    prompt_embeds_key,
    sha256_hash,
)
from vllite.plugins.kv_connectors.transfers import BlockTransfer

if TYPE_CHECKING:
    from vllite.request import Request
    from vllite.sched.output import SchedulerOutput

#: The paged cache's null block (blocks a sliding window dropped point at it): never loaded into or saved.
NULL_BLOCK_ID = 0


def prefix_block_names(request: Request, block_size: int, seed: bytes) -> list[str]:
    """The name of every full prompt block of ``request``: the hex hash chain of its prefixes (token ids, plus the
    LoRA adapter, cache salt and prompt-embeds rows as the prefix cache hashes them), started from ``seed``."""
    tokens = request.prompt_token_ids
    names: list[str] = []
    parent = seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = generate_block_hash_extra_keys(request, start)
        embeds = getattr(request, "prompt_embeds", None)
        if embeds is not None:  # placeholder ids: the embedding rows name the block
            extra = (*(extra or ()), prompt_embeds_key(embeds, start, start + block_size))
        parent = hash_block_tokens(sha256_hash, parent, tokens[start : start + block_size], extra)
        names.append(parent.hex())
    return names


def rewind_saves(tracked: Iterable[TrackedPrefix], invalid: set[int]) -> None:
    """Blocks that failed to load are recomputed: each request's saves restart at its first such block."""
    for entry in tracked:
        first = next((i for i, b in enumerate(entry.block_ids) if b in invalid), None)
        if first is not None:
            entry.saved_blocks = min(entry.saved_blocks, first)


def block_transfer(req_id: str, block_ids: list[int], names: list[str]) -> BlockTransfer:
    """The (block, name) pairs of ``block_ids``/``names`` that are not the null block."""
    pairs = [(b, n) for b, n in zip(block_ids, names) if b != NULL_BLOCK_ID]
    return BlockTransfer(req_id, [b for b, _ in pairs], [n for _, n in pairs])


@dataclass
class TrackedPrefix:
    """What the scheduler role knows about one live request."""

    request: Request
    names: list[str]  # name of each full prompt block, in order
    block_ids: list[int] = field(default_factory=list)
    local_tokens: int = 0  # the local prefix hit at the last lookup
    load: tuple[int, int] | None = None  # blocks [start, end) to load, until the connector takes the load
    saved_blocks: int = 0  # blocks [0, saved_blocks) were saved, found stored or loaded


@dataclass
class ScheduledPrefix:
    """A tracked request scheduled in this step: tokens computed before the step, tokens scheduled in it."""

    tracked: TrackedPrefix
    num_computed: int
    num_new: int


class PrefixBlockTracker:
    """Per live request, which of its full prompt blocks the store holds, is to load, or still has to save.

    Promises: a lookup never reaches the prompt's last token (it is always computed); a block loaded or saved is
    not offered for saving again, unless a failed load (:meth:`rewind`) puts it back; a transfer never names the
    null block; a request is forgotten at :meth:`forget` (or replaced when a new request object reuses its id).
    ``holds(name)`` is the connector's question to its store; it is asked from the scheduler's hot path.
    """

    def __init__(self, block_size: int, seed: bytes, holds: Callable[[str], bool]) -> None:
        self.block_size = block_size
        self._seed = seed
        self._holds = holds
        self._tracked: dict[str, TrackedPrefix] = {}

    def track(self, request: Request) -> TrackedPrefix:
        """The record of ``request``, made (and its block names computed) on first sight."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.request is not request:
            names = prefix_block_names(request, self.block_size, self._seed)
            tracked = self._tracked[request.request_id] = TrackedPrefix(request, names)
        return tracked

    def matched_tokens(self, request: Request, num_computed_tokens: int, consumer: bool = True) -> int:
        """Records the local hit; the tokens of the longest held block-aligned prefix beyond it, excluding the
        prompt's last token (0 when this engine is no ``consumer``)."""
        tracked = self.track(request)
        tracked.local_tokens = num_computed_tokens
        if not consumer:
            return 0
        loadable = (request.num_prompt_tokens - 1) // self.block_size
        block = num_computed_tokens // self.block_size
        while block < loadable and self._holds(tracked.names[block]):
            block += 1
        return max(0, block * self.block_size - num_computed_tokens)

    def allocated(self, request: Request, block_ids: list[int], num_external_tokens: int) -> TrackedPrefix:
        """Records the request's blocks; the blocks its ``num_external_tokens`` fill become its pending load (and
        count as saved); without external tokens it has no pending load."""
        tracked = self.track(request)
        tracked.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            tracked.load = None
            return tracked
        start = tracked.local_tokens // self.block_size
        end = (tracked.local_tokens + num_external_tokens) // self.block_size
        tracked.load = (start, end)
        tracked.saved_blocks = max(tracked.saved_blocks, end)
        return tracked

    def take_load(self, tracked: TrackedPrefix) -> BlockTransfer | None:
        """The pending load of ``tracked`` as a transfer (``None`` when there is none); it is no longer pending."""
        if tracked.load is None:
            return None
        start, end = tracked.load
        tracked.load = None
        return block_transfer(tracked.request.request_id, tracked.block_ids[start:end], tracked.names[start:end])

    def scheduled(self, scheduler_output: SchedulerOutput) -> list[ScheduledPrefix]:
        """Brings the block ids of the step's scheduled requests up to date; the tracked ones, in schedule order."""
        scheduled: list[tuple[str, int]] = []  # (request id, num computed tokens before this step)
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids)
            scheduled.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            new_blocks = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if tracked is not None and new_blocks:
                tracked.block_ids.extend(new_blocks)
            scheduled.append((req_id, cached.num_computed_tokens[i]))
        num_new = scheduler_output.num_scheduled_tokens
        return [
            ScheduledPrefix(self._tracked[req_id], num_computed, num_new.get(req_id, 0))
            for req_id, num_computed in scheduled
            if req_id in self._tracked
        ]

    def saves(self, scheduled: list[ScheduledPrefix]) -> list[BlockTransfer]:
        """The full prompt blocks the step completes that the store does not hold yet, one transfer per request."""
        transfers = []
        for step in scheduled:
            tracked = step.tracked
            end = min(step.num_computed + step.num_new, tracked.request.num_prompt_tokens) // self.block_size
            start = max(tracked.saved_blocks, step.num_computed // self.block_size)
            if end <= start:
                continue
            tracked.saved_blocks = end
            todo = [b for b in range(start, min(end, len(tracked.block_ids))) if not self._holds(tracked.names[b])]
            if todo:
                ids = [tracked.block_ids[b] for b in todo]
                transfers.append(block_transfer(tracked.request.request_id, ids, [tracked.names[b] for b in todo]))
        return transfers

    def rewind(self, invalid: set[int]) -> None:
        """Blocks that failed to load are recomputed: they (and what follows) are to be saved again."""
        if invalid:
            rewind_saves(self._tracked.values(), invalid)

    def forget(self, request: Request) -> None:
        """The request finished."""
        self._tracked.pop(request.request_id, None)
