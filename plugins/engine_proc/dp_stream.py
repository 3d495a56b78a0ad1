"""The merged output stream of data-parallel engines: each engine's output sink, and the notices it carries.

Every engine's output thread calls its sink (``make_merged_sink``): outputs feed the router's load and ownership
bookkeeping, the lockstep wave state and the ``--dp-retry`` ledger, then the one stream the frontend reads; an
engine's death becomes a ``RequestsFailed`` notice for the requests it owned (or their continuation elsewhere).
The sinks refer to no client object, so the client can be garbage-collected while their threads run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from vllite.exceptions import EngineClientClosedError, EngineDeadError
from vllite.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason

from .dp_engines import Sink
from .dp_retry import RetryLedger
from .dp_router import DPRouter
from .dp_waves import WaveCoordinator

logger = logging.getLogger(__name__)


@dataclass
class RequestsFailed:
    """In the merged stream: engine ``engine_index`` died and these requests, which it owned, failed with
    ``error``."""

    engine_index: int
    request_ids: list[str]
    error: EngineDeadError

    def as_outputs(self) -> EngineCoreOutputs:
        """The failure as finished ``error`` outputs (how the synchronous frontend reports a failed request)."""
        message = f"EngineDeadError: {self.error}"
        outputs = [
            EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=message) for rid in self.request_ids
        ]
        return EngineCoreOutputs(engine_index=self.engine_index, outputs=outputs)


StreamItem = EngineCoreOutputs | RequestsFailed | BaseException


@dataclass
class DPResources:
    """The client-wide state the frontends read (``closed``, ``engine_dead``: every engine is dead)."""

    num_engines: int
    closed: bool = False
    engine_dead: bool = False
    dead_message: str | None = None
    dead_engines: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def dead_error(self) -> EngineDeadError:
        """The error every call raises once no engine is left."""
        return EngineDeadError(self.dead_message or "Every data-parallel engine core is dead.", suppress_context=True)


def make_merged_sink(
    engine: int,
    router: DPRouter,
    state: DPResources,
    deliver: Callable[[StreamItem], None],
    waves: WaveCoordinator | None = None,
    broadcast: Callable[[], Callable[[int, int], None] | None] | None = None,
    ledger: RetryLedger | None = None,
    resubmit: Callable[[], Callable[[list[str]], list[str]] | None] | None = None,
) -> Sink:
    """The output sink of engine ``engine``: feeds the router, the wave state (lockstep: ``broadcast()`` gives the
    client's ``START_DP_WAVE`` sender, or None once it is gone), the retry ledger and the merged stream; on the
    engine's death, continues its requests elsewhere (``--dp-retry``: ``resubmit()`` gives the client's sender,
    which returns the ids it could not place) or fails them (and, with no engine left, ends the stream). Refers to
    no client object."""

    def sink(item: EngineCoreOutputs | BaseException) -> None:
        if isinstance(item, EngineCoreOutputs):
            router.on_outputs(engine, item)
            if ledger is not None:
                ledger.on_outputs(item)
            if waves is not None and (item.wave_complete is not None or item.start_wave is not None):
                started = waves.on_outputs(item)
                send = broadcast() if broadcast is not None else None
                if started is not None and send is not None:
                    send(started, engine)
            deliver(item)
            return
        if isinstance(item, EngineClientClosedError):
            return  # this engine is being shut down with the client, which delivers its own notice
        with state.lock:
            if engine in state.dead_engines:
                return
            state.dead_engines.add(engine)
            all_dead = len(state.dead_engines) == state.num_engines
            if all_dead:
                state.engine_dead = True
                state.dead_message = f"Every data-parallel engine core is dead; the last, engine {engine}: {item}"
        failed = router.mark_dead(engine)
        error = EngineDeadError(f"Data-parallel engine core {engine} died: {item}", suppress_context=True)
        continue_elsewhere = resubmit() if resubmit is not None and not all_dead else None
        if continue_elsewhere is not None and failed:
            continued = len(failed)
            failed = continue_elsewhere(failed)
            logger.error("%s; %d of its requests continue on live engines", error, continued - len(failed))
        logger.error("%s; %d of its requests failed", error, len(failed))
        if failed:
            deliver(RequestsFailed(engine, failed, error))
        if all_dead:
            deliver(state.dead_error())

    return sink
