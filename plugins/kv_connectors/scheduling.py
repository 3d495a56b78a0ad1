"""``KVTransferState``: the scheduler's side of a KV connector, as one object the scheduler holds only when
``config.kv_transfer_config`` is set (``Scheduler.kv_transfer``; ``None`` keeps every hot path to one check). The
kernel names what it calls in ``vllite.kv_connector.scheduler_side.KVTransfer`` and builds it through
``make_kv_transfer`` here, by class path (this module used to be ``vllite.sched.kv_transfer``).

It owns what the token-budget algorithm needs beyond the connector's own calls:

- ``remote_loads``: requests parked in ``WAITING_FOR_REMOTE_KVS`` (their blocks allocated, an asynchronous load in
  flight) → the tokens they will have computed once it lands;
- ``finished_recving``: parked requests whose load the worker reported done (promoted when admission looks at them);
- ``held``: finished requests whose blocks stay allocated for the connector (it is still sending their KV, or a
  load into them was in flight when they finished) → what is still awaited (``"send"``, ``"recv"``). When nothing
  is, the blocks go to the policy's ``on_request_finished`` (exactly once).

Load failures (``KVConnectorOutput.invalid_block_ids``): every request whose computed (or loading) range holds a
failed block — or a block computed on top of one — is affected from its first such block; those blocks leave the
prefix cache. ``recompute`` rolls ``num_computed_tokens`` back to that block (a running request's tokens sampled
this step are dropped); ``fail`` finishes the request with ERROR (``KVLoadError``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllite.exceptions import PluginHookError
from vllite.kv_cache.manager import PrefixCacheStats
from vllite.kv_connector.base import KVConnectorRole
from vllite.kv_connector.factory import create_connector
from vllite.kv_connector.scheduler_side import KVTransfer
from vllite.plugins.kv_connectors.errors import KVLoadError
from vllite.request import Request, RequestStatus
from vllite.sched.faults import release_finished

if TYPE_CHECKING:
    from vllite.kv_connector.base import KVConnectorBase, KVConnectorOutput
    from vllite.kv_connector.config import KVTransferConfig
    from vllite.sched.output import SchedulerOutput
    from vllite.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

_NOTHING: frozenset[str] = frozenset()


def make_kv_transfer(scheduler: Scheduler) -> KVTransferState | None:
    """The scheduler-role connector named by ``config.kv_transfer_config``, or ``None`` without one."""
    kv_transfer_config = getattr(scheduler.config, "kv_transfer_config", None)
    if kv_transfer_config is None:
        return None
    connector = create_connector(scheduler.config, KVConnectorRole.SCHEDULER, kv_transfer_config)
    return KVTransferState(connector, kv_transfer_config)


class KVTransferState(KVTransfer):
    """The scheduler-role connector and the transfer bookkeeping (see the module docstring)."""

    def __init__(self, connector: KVConnectorBase, kv_transfer_config: KVTransferConfig) -> None:
        self.connector = connector
        self.recompute_failed_loads = kv_transfer_config.kv_load_failure_policy == "recompute"
        self.remote_loads: dict[str, int] = {}
        self.finished_recving: set[str] = set()
        self.held: dict[str, tuple[Request, set[str]]] = {}
        # Admitted with a synchronous load this step: their blocks are cached once no load failure is reported.
        self.unverified: list[Request] = []
        # Lookups of admitted requests since the last stats (vLLM's external prefix cache queries and hits).
        self.lookup_stats = PrefixCacheStats()
        self._shut_down = False

    def shutdown(self) -> None:
        """Shuts the connector down, once."""
        if not self._shut_down:
            self._shut_down = True
            self.connector.shutdown()

    # ------------------------------------------------------------------ admission
    def lookup(self, request: Request, num_computed: int) -> tuple[int, bool] | None:
        """External tokens beyond ``num_computed`` (local hit included) and whether they load asynchronously;
        ``None``: ask again next step. Never covers the last prompt token."""
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_computed)
        if num_external is None:
            return None
        num_external = max(0, min(int(num_external), request.num_tokens - 1 - num_computed))
        return num_external, bool(load_async) and num_external > 0

    def record_lookup(self, request: Request, num_external: int) -> None:
        """Counts the lookup of an admitted request: its tokens queried, ``num_external`` of them found."""
        self.lookup_stats.record(request.num_tokens, num_external)

    def take_lookup_stats(self) -> PrefixCacheStats:
        """The lookups counted since the previous call."""
        stats, self.lookup_stats = self.lookup_stats, PrefixCacheStats()
        return stats

    def park(self, request: Request, num_computed_when_loaded: int) -> None:
        """An asynchronous load was set up for ``request`` (its blocks are allocated): it waits for the worker."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.remote_loads[request.request_id] = num_computed_when_loaded

    def try_unblock(self, scheduler: Scheduler, request: Request) -> bool:
        """Whether a blocked waiting request may be admitted now; a finished load makes it WAITING (PREEMPTED if it
        ran before) with ``num_computed_tokens`` covering the loaded tokens, its loaded blocks cached."""
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False
        request_id = request.request_id
        if request_id not in self.finished_recving:
            return False
        self.finished_recving.discard(request_id)
        num_computed = self.remote_loads.pop(request_id, 0)
        kv = scheduler.kv_cache_manager
        if num_computed > 0:
            request.num_computed_tokens = num_computed
            kv.cache_blocks(request, num_computed)
        else:  # nothing usable arrived: start over (the local prefix cache may still hit)
            kv.free(request)
        request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        return True

    def release_landed(self, scheduler: Scheduler, skipped: list[Request], head: Request) -> bool:
        """Admission is out of blocks and nothing runs: frees the blocks of one waiting request whose load has
        landed (the latest in queue order, ``head`` last), which will compute or load them again. Without this,
        landed loads could hold every block while the head waits for one more. False when there is none (loads
        still in flight land by themselves)."""
        kv = scheduler.kv_cache_manager
        for request in [*reversed(list(scheduler.waiting)), *reversed(skipped), head]:
            request_id = request.request_id
            if request is head and not kv.get_block_ids(request_id):
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request_id not in self.finished_recving:
                    continue  # the worker may still write into its blocks
                self.finished_recving.discard(request_id)
                del self.remote_loads[request_id]
                request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            elif not kv.get_block_ids(request_id):
                continue
            logger.info("Request %r: its KV blocks are released to make room (it will compute them again).", request_id)
            kv.free(request)
            request.num_computed_tokens = 0
            return True
        return False

    # ------------------------------------------------------------------ finishing
    def hold_finished(self, scheduler: Scheduler, request: Request) -> bool:
        """``request_finished`` (exactly once per request); True when the blocks stay allocated for the connector
        (it still sends them, or a load into them is in flight) and go to the policy once it reports done."""
        request_id = request.request_id
        awaited: set[str] = set()
        if request_id in self.remote_loads:
            del self.remote_loads[request_id]
            if request_id in self.finished_recving:
                self.finished_recving.discard(request_id)
            else:
                awaited.add("recv")
        try:
            delay_free, params = self.connector.request_finished(
                request, scheduler.kv_cache_manager.get_block_ids(request_id)
            )
        except Exception as exc:
            logger.error("Request %r: %s", request_id, PluginHookError(self.connector, "request_finished", exc))
            delay_free, params = False, None
        request.kv_transfer_params = params
        if delay_free:
            awaited.add("send")
        if not awaited:
            return False
        self.held[request_id] = (request, awaited)
        return True

    def _transfer_done(self, scheduler: Scheduler, request_id: str, kind: str) -> None:
        entry = self.held.get(request_id)
        if entry is None:
            return
        request, awaited = entry
        awaited.discard(kind)
        if not awaited:
            del self.held[request_id]
            release_finished(scheduler, request)

    # ------------------------------------------------------------------ step results
    def build_meta(self, output: SchedulerOutput) -> None:
        """The connector's metadata for this step, onto ``output``."""
        output.kv_connector_metadata = self.connector.build_connector_meta(output)

    def update_from_output(
        self, scheduler: Scheduler, kv_output: KVConnectorOutput | None
    ) -> frozenset[str] | set[str]:
        """Applies the worker's transfer results before the step's tokens; returns the running requests whose
        tokens of this step must be dropped (their KV load failed and they recompute)."""
        if kv_output is None:
            self._cache_verified(scheduler, _NOTHING)
            return _NOTHING
        self.connector.update_connector_output(kv_output)
        for request_id in kv_output.finished_recving:
            if request_id in self.remote_loads:
                self.finished_recving.add(request_id)
            else:
                self._transfer_done(scheduler, request_id, "recv")
        for request_id in kv_output.finished_sending:
            self._transfer_done(scheduler, request_id, "send")
        skip: frozenset[str] | set[str] = _NOTHING
        if kv_output.invalid_block_ids:
            skip = self.handle_invalid_blocks(scheduler, set(kv_output.invalid_block_ids))
        self._cache_verified(scheduler, skip)
        return skip

    def _cache_verified(self, scheduler: Scheduler, recomputing: frozenset[str] | set[str]) -> None:
        """Registers in the prefix cache the blocks of requests whose synchronous load (and the step computing
        on top of it) is now known to have worked."""
        if not self.unverified:
            return
        kv = scheduler.kv_cache_manager
        for request in self.unverified:
            if request.status == RequestStatus.RUNNING and request.request_id not in recomputing:
                kv.cache_blocks(request, request.num_computed_tokens)
        self.unverified = []

    def handle_invalid_blocks(self, scheduler: Scheduler, invalid: set[int]) -> set[str]:
        """Applies ``kv_load_failure_policy`` to every request affected by the failed blocks ``invalid``."""
        kv = scheduler.kv_cache_manager
        block_size = scheduler.block_size
        candidates: list[tuple[Request, int]] = [
            (r, -(-r.num_computed_tokens // block_size)) for r in scheduler.running
        ]
        for request_id, num_computed in self.remote_loads.items():
            parked = scheduler.requests.get(request_id)
            if parked is not None:
                candidates.append((parked, -(-num_computed // block_size)))
        tainted = set(invalid)
        affected: dict[str, tuple[Request, int]] = {}
        changed = True
        while changed:  # a block computed on top of a failed one is as wrong as it, wherever it is shared
            changed = False
            for request, limit in candidates:
                block_ids = kv.get_block_ids(request.request_id)[:limit]
                first = next((i for i, block_id in enumerate(block_ids) if block_id in tainted), None)
                previous = affected.get(request.request_id)
                if first is None or (previous is not None and previous[1] <= first):
                    continue
                affected[request.request_id] = (request, first)
                later = set(block_ids[first:]) - tainted
                if later:
                    tainted |= later
                    changed = True
        kv.evict_blocks(tainted)
        skip: set[str] = set()
        for request_id, (request, first) in affected.items():
            num_good = first * block_size
            if self.recompute_failed_loads:
                logger.warning("Request %r: KV load failed from token %d on; recomputing.", request_id, num_good)
                if request_id in self.remote_loads:
                    self.remote_loads[request_id] = min(self.remote_loads[request_id], num_good)
                else:
                    request.num_computed_tokens = min(request.num_computed_tokens, num_good)
                    request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
                    request.spec_token_ids = []
                    skip.add(request_id)
                continue
            failed = sorted(set(kv.get_block_ids(request_id)) & invalid)
            error = KVLoadError(
                f"The KV connector failed to load KV blocks {failed} of request {request_id!r} "
                "(kv_load_failure_policy='fail'; 'recompute' would compute them instead)."
            )
            if request.status == RequestStatus.RUNNING:
                scheduler.running.remove(request)
            else:
                scheduler.waiting.remove_requests([request])
            scheduler.fail_request(request, str(error))
        return skip
