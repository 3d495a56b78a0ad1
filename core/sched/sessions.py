"""Sessions in the scheduler: resumable requests that take their input in chunks and keep their KV between turns.

Plain functions behind ``Scheduler`` (``add_session_chunk``, the turn end in ``update_from_output``, the releases
in ``schedule``), like ``phases`` and ``updates``. A session is one ``Request`` for its whole life:

- **A turn ends** (EOS, a stop token, ``max_tokens``): unless its input has ended, the request stays registered.
  The workers are told to drop it (``finished_req_ids``; the clients are not), and it either resumes at once with
  a chunk that arrived meanwhile, or **parks**: ``WAITING_FOR_STREAMING_REQ``, in no queue, holding its blocks.
- **Holding is a pin** whose length the policy decides (``Scheduler.session_hold_seconds``). Held blocks are
  released when the hold expires (top of ``schedule()``) and by ``reset_prefix_cache``. When a running request (or
  the waiting head, with nothing running) cannot get blocks, holds give way **block by block from the tail**
  before the policy releases anything of its own or preempts: the hold that expires first gives up just the blocks
  missing, keeping the head of its history (a session with no block left is released). A released session's
  blocks return to the pool with their hashes, so its next turn recomputes only what the prefix cache lost; a
  trimmed one recomputes only its cut tail.
- **The next chunk** appends its tokens to everything so far (the last sampled token included) and queues the
  session as a new arrival; with its blocks held, only the new tokens are prefilled. While it waits for admission
  its blocks stay releasable (a hold with no expiry), so queued sessions never hold what the queue's head needs.
- **The end of the input** finishes a parked session with its last turn's status (or, queued behind a running turn,
  lets that turn finish the request). An abort ends a session at any point, as any request.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import TYPE_CHECKING

from vllite.exceptions import PluginHookError, SessionClosedError
from vllite.protocol import EngineCoreEventType
from vllite.request import Request, RequestStatus, StreamingUpdate
from vllite.sched.faults import fail_request

if TYPE_CHECKING:
    from vllite.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

_TURN_END = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class SessionHolds:
    """Parked sessions whose KV blocks are held, each until its expiry (scheduler clock).

    Promises: a session is held at most once; ``pop_expired`` and ``pop_soonest`` hand out sessions in expiry
    order (then holding order) and forget them; ``soonest`` names the next one without forgetting it.
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[float, int, Request]] = {}
        self._heap: list[tuple[float, int, str]] = []  # may keep entries of forgotten holds, see _compact
        self._seq = itertools.count()
        self.num_blocks_released_for_memory = 0  # held blocks given up because another request needed blocks

    def hold(self, request: Request, expiry: float) -> None:
        """Holds ``request``'s blocks until ``expiry``; ``math.inf``: a session queued for its next turn."""
        seq = next(self._seq)
        self._held[request.request_id] = (expiry, seq, request)
        heapq.heappush(self._heap, (expiry, seq, request.request_id))
        if len(self._heap) > 2 * len(self._held) + 16:
            self._compact()

    def _compact(self) -> None:
        """Drops the heap entries of forgotten holds (each admitted turn leaves one, never expiring)."""
        self._heap = [(expiry, seq, request_id) for request_id, (expiry, seq, _) in self._held.items()]
        heapq.heapify(self._heap)

    def discard(self, request_id: str) -> bool:
        """Forgets the hold of ``request_id`` (the blocks stay where they are); whether there was one."""
        return self._held.pop(request_id, None) is not None

    def is_queued(self, request_id: str) -> bool:
        """Whether ``request_id`` is a session queued for its next turn with its blocks held."""
        entry = self._held.get(request_id)
        return entry is not None and entry[0] == math.inf

    @property
    def num_queued(self) -> int:
        """Sessions queued for their next turn with their blocks held."""
        return sum(1 for entry in self._held.values() if entry[0] == math.inf)

    def soonest(self, other_than: str | None = None) -> Request | None:
        """The held session whose hold expires first (then the one held first), other than ``other_than``; it
        stays held. ``None`` when there is none."""
        entries = (entry for request_id, entry in self._held.items() if request_id != other_than)
        entry = min(entries, key=lambda e: (e[0], e[1]), default=None)
        return entry[2] if entry is not None else None

    def pop_soonest(self) -> Request | None:
        """The held session whose hold expires first, no longer held; ``None`` when none is."""
        request = self.soonest()
        if request is not None:
            del self._held[request.request_id]
        return request

    def pop_expired(self, now: float) -> list[Request]:
        """The held sessions whose hold expired by ``now``, no longer held."""
        expired: list[Request] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, seq, request_id = heapq.heappop(heap)
            entry = self._held.get(request_id)
            if entry is not None and entry[1] == seq:
                del self._held[request_id]
                expired.append(entry[2])
        return expired

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held


def add_chunk(scheduler: Scheduler, chunk: Request) -> None:
    """``Scheduler.add_session_chunk``: the next input chunk of the live session ``chunk.request_id`` (or the end of
    its input). Resumes a parked session at once; otherwise the chunk waits in the session's ``streaming_queue``
    for the running turn to end. ``SessionClosedError`` when no such session is open."""
    session = scheduler.requests.get(chunk.request_id)
    queue = session.streaming_queue if session is not None else None
    if session is None or queue is None or (queue and queue[-1] is None):
        raise SessionClosedError(
            f"Session {chunk.request_id!r} is not open (unknown, finished, or its input already ended)."
        )
    update = StreamingUpdate.from_request(chunk)
    if session.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
        queue.append(update)
    elif update is None:
        close_parked(scheduler, session)
    else:
        resume(scheduler, session, update)


def keeps_session_open(request: Request, max_model_len: int) -> bool:
    """Whether a request that just finished only ended a session's turn: it is resumable, its turn stopped or hit
    ``max_tokens``, the context has room for more, and its input has not ended."""
    if not request.resumable or request.status not in _TURN_END or request.num_tokens >= max_model_len:
        return False
    queue = request.streaming_queue
    return not (queue and queue[0] is None)


def continue_session(scheduler: Scheduler, request: Request) -> None:
    """After a turn ended (already out of the running list and the queues, its output built): the workers drop
    the request, whose KV is kept; it resumes with a queued chunk, or parks."""
    request.last_turn_status = request.status
    scheduler.finished_req_ids.add(request.request_id)  # the workers only: it comes back as a new request
    # The last sampled token has no KV yet (nor tokens a stop cut off after accepted drafts).
    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
    request.spec_token_ids = []
    queue = request.streaming_queue
    if queue:
        update = queue.popleft()
        assert update is not None, "keeps_session_open() lets the end of the input finish the request"
        resume(scheduler, request, update)
    else:
        park(scheduler, request)


def park(scheduler: Scheduler, request: Request) -> None:
    """Parks a session between turns, holding its blocks for as long as the policy says."""
    request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
    try:
        seconds = float(scheduler.session_hold_seconds(request))
    except Exception as exc:
        logger.error("%s; the session's blocks are released.", PluginHookError(scheduler, "session_hold_seconds", exc))
        seconds = 0.0
    if seconds > 0.0 and not math.isnan(seconds):
        scheduler.session_holds.hold(request, scheduler.clock() + seconds)
    else:
        release(scheduler, request)


def release(scheduler: Scheduler, request: Request) -> None:
    """Frees a parked session's blocks (their hashes stay in the prefix cache until reused); its next turn
    recomputes what is lost."""
    scheduler.kv_cache_manager.free(request)
    request.num_computed_tokens = 0


def release_expired(scheduler: Scheduler) -> None:
    """Releases the blocks of the sessions whose hold expired."""
    for request in scheduler.session_holds.pop_expired(scheduler.clock()):
        release(scheduler, request)


def release_for_memory(scheduler: Scheduler, num_blocks: int, other_than: str | None = None) -> bool:
    """Frees up to ``num_blocks`` blocks that a request (``other_than``, when it is a held session itself) lacks:
    the tail of the held session whose hold expires first, which keeps the head of its history and is released
    when no block is left. Whether a hold gave way (a block shared with another request frees no memory: call
    again while blocks are missing).

    Only the missing blocks go: a whole released session would feed its blocks to new requests, and its next turn
    would recompute it all once they are evicted, which under memory pressure is what happens to most of them.
    """
    holds = scheduler.session_holds
    request = holds.soonest(other_than)
    if request is None:
        return False
    kv = scheduler.kv_cache_manager
    num_held = len(kv.get_block_ids(request.request_id))  # every KV-cache group's blocks
    num_kept = kv.free_tail(request, max(1, num_blocks))  # logical block positions, kept in every group
    holds.num_blocks_released_for_memory += num_held - num_kept * kv.num_groups
    if num_kept == 0:
        holds.discard(request.request_id)
        release(scheduler, request)
    else:
        request.num_computed_tokens = min(request.num_computed_tokens, num_kept * kv.block_size)
    return True


def release_all(scheduler: Scheduler) -> None:
    """Releases every held session (``reset_prefix_cache``)."""
    while (request := scheduler.session_holds.pop_soonest()) is not None:
        release(scheduler, request)


def resume(scheduler: Scheduler, session: Request, update: StreamingUpdate) -> None:
    """Starts the session's next turn with ``update`` and queues it; a chunk that would overflow the context ends the
    session with ERROR. Until it is admitted, its blocks stay releasable (held with no expiry, so parked sessions
    go first): a queued session must not hold blocks the head of the queue needs."""
    holds = scheduler.session_holds
    holds.discard(session.request_id)
    num_tokens = session.num_tokens + len(update.prompt_token_ids)
    if num_tokens > scheduler.max_model_len:
        message = (
            f"Session {session.request_id!r} would hold {num_tokens} tokens with its next input chunk, more than "
            f"max_model_len ({scheduler.max_model_len})."
        )
        fail_request(scheduler, session, message)
        return
    session.start_next_turn(update)
    if session.num_computed_tokens > 0:
        holds.hold(session, math.inf)
    scheduler.waiting.add_request(session)
    if scheduler.log_stats:
        session.record_event(EngineCoreEventType.QUEUED, scheduler.clock())
    try:
        scheduler.on_session_resumed(session)
    except Exception as exc:
        logger.error("Session %r: %s", session.request_id, PluginHookError(scheduler, "on_session_resumed", exc))


def close_parked(scheduler: Scheduler, session: Request) -> None:
    """The input of a parked session ended: it finishes with its last turn's status; its finish output goes out
    with the next ``update_from_output``."""
    scheduler.session_holds.discard(session.request_id)
    session.status = session.last_turn_status or RequestStatus.FINISHED_STOPPED
    scheduler._free_request(session)
    scheduler.closed_sessions.append(session)
