"""``p2p``: prefill/decode disaggregation, the KV moving from a producer engine to a consumer engine over ZMQ.

As vLLM's disaggregated-serving example: a request goes to the prefill engine
(``{"kv_connector": "p2p", "kv_role": "kv_producer"}``) with ``max_tokens=1``; its ``RequestOutput.kv_transfer_params``
say where and what to fetch (``remote_address``, ``transfer_id``, ``num_tokens``, ``num_blocks``, ``block_size``).
The same prompt then goes to the decode engine (``"kv_role": "kv_consumer"``) with
``SamplingParams(extra_args={"kv_transfer_params": params})``, which loads those tokens (the prompt less its last
token) asynchronously instead of computing them.

Extra config: ``p2p_host`` (``127.0.0.1``), ``p2p_port`` (0: a free port), ``p2p_timeout_s`` (3: a fetch with no
answer by then is a load error), ``p2p_send_timeout_s`` (60: a producer frees blocks nobody fetched by then; 0
frees them at once, which only a producer on its own, as in the conformance kit, wants).

Scheduler role, producer: ``request_finished`` of a request that stopped normally returns ``(True, params)`` and
hands its blocks to the worker (``P2PMetadata.sends``); the blocks are freed once the worker reports them fetched
(``finished_sending``). The worker's address reaches the scheduler role through ``kv_connector_stats``. Consumer:
``get_num_new_matched_tokens`` reports the tokens of the request's ``kv_transfer_params`` beyond the local prefix
hit, async; the worker pulls them on a background thread (:mod:`.p2p_worker`). A failed fetch is
a load error (recomputed or failed per ``kv_load_failure_policy``); a request loads from its producer once.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllite.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole
from vllite.request import RequestStatus

if TYPE_CHECKING:
    import torch

    from vllite.config import EngineConfig
    from vllite.kv_connector.config import KVTransferConfig
    from vllite.plugins.kv_connectors.p2p_worker import P2PLoad, P2PSend, P2PWorker
    from vllite.request import Request
    from vllite.sched.output import SchedulerOutput

_STOPPED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def _number(kv_transfer_config: KVTransferConfig, key: str, default: float) -> float:
    """A non-negative number from the extra config; ``ValueError`` naming the field otherwise."""
    value = kv_transfer_config.get_from_extra_config(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config.{key} must be a non-negative number, got {value!r}."
        )
    return float(value)


def remote_params(request: Request) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` the request was sent with (``sampling_params.extra_args``), if any."""
    extra = request.sampling_params.extra_args or {}
    params = extra.get("kv_transfer_params")
    return params if isinstance(params, dict) and params.get("transfer_id") else None


@dataclass
class P2PMetadata(KVConnectorMetadata):
    """One step's work for the worker: blocks to fetch from producers, blocks to offer to consumers."""

    loads: list[P2PLoad] = field(default_factory=list)
    sends: list[P2PSend] = field(default_factory=list)


class P2PConnector(KVConnectorBase):
    """Both roles of the ``p2p`` connector (registered under that name by the builtin plugin)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        super().__init__(config, role, kv_transfer_config)
        self.block_size = config.cache_config.block_size
        self.host = str(kv_transfer_config.get_from_extra_config("p2p_host", "127.0.0.1"))
        self.port = int(_number(kv_transfer_config, "p2p_port", 0))
        self.timeout_s = _number(kv_transfer_config, "p2p_timeout_s", 3.0)
        self.send_timeout_s = _number(kv_transfer_config, "p2p_send_timeout_s", 60.0)
        self.address: str | None = None  # the producer worker's, as it reported (scheduler role)
        self._attempted: set[str] = set()  # requests whose load was set up: they load once (scheduler role)
        self._local: dict[str, int] = {}  # request id -> local prefix hit at the last lookup
        self._loads: list[P2PLoad] = []
        self._sends: list[P2PSend] = []
        self.num_loads = 0
        self.num_loaded_tokens = 0
        self.num_sends = 0
        self.worker: P2PWorker | None = None
        self._address_reported = False
        if role == KVConnectorRole.WORKER:
            from vllite.plugins.kv_connectors.p2p_worker import P2PWorker

            serve = kv_transfer_config.is_kv_producer
            self.worker = P2PWorker(self.host, self.port, self.timeout_s, self.send_timeout_s, serve)

    # ------------------------------------------------------------------ scheduler role
    def _loadable(self, request: Request) -> int:
        """How many prompt tokens the request's producer holds for it (never the last prompt token)."""
        params = remote_params(request)
        if params is None or not self.kv_transfer_config.is_kv_consumer:
            return 0
        if params.get("block_size") != self.block_size or request.request_id in self._attempted:
            return 0
        return max(0, min(int(params.get("num_tokens", 0)), request.num_prompt_tokens - 1))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The tokens the producer computed beyond the local hit; loaded asynchronously."""
        self._local[request.request_id] = num_computed_tokens
        num = max(0, self._loadable(request) - num_computed_tokens)
        return num, num > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        from vllite.plugins.kv_connectors.p2p_worker import P2PLoad

        params = remote_params(request)
        assert params is not None, "external tokens without kv_transfer_params"
        local = self._local.get(request.request_id, 0)
        start = local // self.block_size
        end = -(-(local + num_external_tokens) // self.block_size)
        load = P2PLoad(
            request.request_id,
            str(params["remote_address"]),
            str(params["transfer_id"]),
            start,
            list(block_ids[start:end]),
        )
        self._loads.append(load)
        self._attempted.add(request.request_id)
        self.num_loads += 1
        self.num_loaded_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = P2PMetadata(loads=self._loads, sends=self._sends)
        self._loads, self._sends = [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learns the producer worker's address from its first report."""
        stats = connector_output.kv_connector_stats
        if stats and stats.get("p2p_address"):
            self.address = str(stats["p2p_address"])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A producer keeps a normally finished request's prompt blocks until the consumer fetched them."""
        from vllite.plugins.kv_connectors.p2p_worker import P2PSend

        self._attempted.discard(request.request_id)
        self._local.pop(request.request_id, None)
        if self.kv_transfer_config.kv_role != "kv_producer" or self.address is None or request.status not in _STOPPED:
            return False, None
        num_tokens = min(request.num_prompt_tokens - 1, request.num_computed_tokens)
        num_blocks = -(-num_tokens // self.block_size)
        if num_tokens <= 0 or len(block_ids) < num_blocks:
            return False, None
        transfer_id = uuid.uuid4().hex
        self._sends.append(P2PSend(request.request_id, transfer_id, list(block_ids[:num_blocks])))
        self.num_sends += 1
        params = {
            "remote_address": self.address,
            "transfer_id": transfer_id,
            "num_tokens": num_tokens,
            "num_blocks": num_blocks,
            "block_size": self.block_size,
            "remote_engine_id": self.kv_transfer_config.engine_id,
        }
        return True, params

    # ------------------------------------------------------------------ worker role
    def _worker_meta(self) -> P2PMetadata:
        meta = self._metadata
        return meta if isinstance(meta, P2PMetadata) else P2PMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None, "register_kv_caches on a scheduler-role connector"
        self.worker.register(kv_caches)

    def start_load_kv(self, **kwargs: Any) -> None:
        if self.worker is not None:
            meta = self._worker_meta()
            self.worker.offer(meta.sends)
            self.worker.fetch(meta.loads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        return self.worker.take_sent(), self.worker.loads.take_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.loads.take_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The producer's address, reported once (the scheduler role puts it in ``kv_transfer_params``)."""
        if self.worker is None or self.worker.address is None or self._address_reported:
            return None
        self._address_reported = True
        return {"p2p_address": self.worker.address}

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
