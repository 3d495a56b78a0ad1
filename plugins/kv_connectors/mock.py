"""``MockKVConnector``: a pure-Python KV connector for scheduler tests and for connector authors (vLLM's tests'
``MockKVConnector``, extended), plus a harness that plays the worker side without a model.

Select it by class path: ``{"kv_connector": "vllite.plugins.kv_connectors.mock:MockKVConnector",
"kv_role": "kv_both", "kv_connector_extra_config": {...}}``. Settings (``kv_connector_extra_config``; tests may also
change the attributes of the same names, or per request through ``overrides[request_id] = {...}``):

- ``matched_tokens`` (0): external tokens offered beyond the local hit; -1 = all the engine may load.
- ``is_async`` (False): loads are asynchronous; the request waits in ``WAITING_FOR_REMOTE_KVS``.
- ``load_steps`` (1): worker steps an asynchronous load takes (reported in ``finished_recving`` on the last).
- ``num_defers`` (0): how many times a request is answered ``None`` (ask again later) before matching.
- ``delay_free_steps`` (0): > 0 makes ``request_finished`` keep the blocks (as if sending the KV) for that many
  worker steps, then ``finished_sending`` names the request.
- ``fail_loads`` (0): how many loads of each request fail (their first block, in ``invalid_block_ids``).
- ``kv_transfer_params`` (None): what ``request_finished`` returns for the request's output.
- ``seed`` (None): answer at random (matched tokens, async, deferrals, delayed frees, failures) from this seed.

The scheduler role records what it was asked (``calls``, ``finished``) so tests can assert the contract.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllite.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole
from vllite.testing.scheduler import ScriptedModelRunner

if TYPE_CHECKING:
    from vllite.config import EngineConfig
    from vllite.kv_connector.config import KVTransferConfig
    from vllite.request import Request
    from vllite.sched.output import ModelRunnerOutput, SchedulerOutput

MOCK_CONNECTOR = "vllite.plugins.kv_connectors.mock:MockKVConnector"


@dataclass
class MockLoad:
    """One load the worker is to run: into ``block_ids``, ``num_tokens`` tokens, ``failed_block_ids`` failing."""

    block_ids: list[int]
    num_tokens: int
    is_async: bool
    steps: int
    failed_block_ids: set[int] = field(default_factory=set)


@dataclass
class MockKVConnectorMetadata(KVConnectorMetadata):
    """This step's loads and the sends of requests that finished since the previous step (→ steps they take)."""

    loads: dict[str, MockLoad] = field(default_factory=dict)
    sends: dict[str, int] = field(default_factory=dict)


class MockKVConnector(KVConnectorBase):
    """See the module docstring; both roles in one class, as every connector."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        super().__init__(config, role, kv_transfer_config)
        extra = kv_transfer_config.kv_connector_extra_config
        self.matched_tokens: int = int(extra.get("matched_tokens", 0))
        self.is_async: bool = bool(extra.get("is_async", False))
        self.load_steps: int = int(extra.get("load_steps", 1))
        self.num_defers: int = int(extra.get("num_defers", 0))
        self.delay_free_steps: int = int(extra.get("delay_free_steps", 0))
        self.fail_loads: int = int(extra.get("fail_loads", 0))
        self.kv_transfer_params: dict[str, Any] | None = extra.get("kv_transfer_params")
        seed = extra.get("seed")
        self.rng: random.Random | None = random.Random(seed) if seed is not None else None
        self.overrides: dict[str, dict[str, Any]] = {}
        self.block_size = config.cache_config.block_size
        # Scheduler-role state and records.
        self.calls: Counter[str] = Counter()
        self.finished: list[str] = []  # request ids, in request_finished order
        self.outputs: list[KVConnectorOutput] = []
        self._defers: Counter[str] = Counter()
        self._num_local: dict[str, int] = {}
        self._failures: Counter[str] = Counter()
        self._loads: dict[str, MockLoad] = {}
        self._sends: dict[str, int] = {}
        # Worker-role state: request id -> (steps left, failed blocks to report when done).
        self._recving: dict[str, tuple[int, set[int]]] = {}
        self._sending: dict[str, int] = {}
        self._errors: set[int] = set()

    def _setting(self, request_id: str, name: str) -> Any:
        override = self.overrides.get(request_id)
        if override is not None and name in override:
            return override[name]
        return getattr(self, name)

    # ------------------------------------------------------------------ scheduler role
    def on_new_request(self, request: Request) -> None:
        self.calls["on_new_request"] += 1

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.calls["get_num_new_matched_tokens"] += 1
        request_id = request.request_id
        self._num_local[request_id] = num_computed_tokens
        loadable = max(0, request.num_tokens - 1 - num_computed_tokens)
        rng = self.rng
        if rng is not None:
            if rng.random() < 0.15:
                return None, False
            num = rng.choice((0, rng.randrange(loadable + 1), loadable))
            return num, num > 0 and rng.random() < 0.5
        if self._defers[request_id] < self._setting(request_id, "num_defers"):
            self._defers[request_id] += 1
            return None, False
        matched = self._setting(request_id, "matched_tokens")
        num = loadable if matched < 0 else min(matched, loadable)
        return num, num > 0 and bool(self._setting(request_id, "is_async"))

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.calls["update_state_after_alloc"] += 1
        if num_external_tokens == 0:
            return
        request_id = request.request_id
        # The external tokens follow the local hit (whole blocks) the lookup was told about.
        num_local = self._num_local.get(request_id, 0)
        first = num_local // self.block_size
        last = -(-(num_local + num_external_tokens) // self.block_size)
        load_blocks = block_ids[first:last]
        rng = self.rng
        if rng is not None:
            failing = rng.random() < 0.1
        else:
            failing = self._failures[request_id] < int(self._setting(request_id, "fail_loads"))
            self._failures[request_id] += failing
        steps = rng.randrange(1, 4) if rng is not None else max(1, int(self._setting(request_id, "load_steps")))
        self._loads[request_id] = MockLoad(
            block_ids=load_blocks,
            num_tokens=num_external_tokens,
            is_async=False,  # set by build_connector_meta: a load whose request was not scheduled is asynchronous
            steps=steps,
            failed_block_ids={load_blocks[0]} if failing and load_blocks else set(),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.calls["build_connector_meta"] += 1
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, load in self._loads.items():
            load.is_async = request_id not in scheduled  # parked in WAITING_FOR_REMOTE_KVS
        meta = MockKVConnectorMetadata(loads=self._loads, sends=self._sends)
        self._loads, self._sends = {}, {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.calls["update_connector_output"] += 1
        self.outputs.append(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self.calls["request_finished"] += 1
        self.finished.append(request_id)
        self._num_local.pop(request_id, None)
        self._defers.pop(request_id, None)
        self._failures.pop(request_id, None)
        rng = self.rng
        steps = rng.choice((0, 0, 1, 3)) if rng is not None else int(self._setting(request_id, "delay_free_steps"))
        params = self._setting(request_id, "kv_transfer_params")
        if steps > 0 and block_ids:
            self._sends[request_id] = steps
            return True, params
        return False, params

    # ------------------------------------------------------------------ worker role
    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, MockKVConnectorMetadata), meta
        for request_id, load in meta.loads.items():
            if load.is_async:
                self._recving[request_id] = (load.steps, set(load.failed_block_ids))
            else:
                self._errors |= load.failed_block_ids

    def wait_for_save(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, MockKVConnectorMetadata), meta
        self._sending.update(meta.sends)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent: set[str] = set()
        for request_id, steps in list(self._sending.items()):
            if steps <= 1:
                del self._sending[request_id]
                sent.add(request_id)
            else:
                self._sending[request_id] = steps - 1
        received: set[str] = set()
        for request_id, (steps, failed) in list(self._recving.items()):
            if steps <= 1:
                del self._recving[request_id]
                received.add(request_id)
                self._errors |= failed
            else:
                self._recving[request_id] = (steps - 1, failed)
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    @property
    def num_transfers_in_flight(self) -> int:
        """Worker role: loads and sends not reported done yet."""
        return len(self._recving) + len(self._sending)


def run_worker_connector(worker: KVConnectorBase, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
    """One step of a worker-role connector without a model, in the order the model runner calls it: bind, start
    loads, (no layers), wait for saves, collect finished transfers, failed loads and the connector's
    stats, clear."""
    metadata = scheduler_output.kv_connector_metadata
    worker.bind_connector_metadata(metadata if metadata is not None else KVConnectorMetadata())
    try:
        worker.start_load_kv()
        worker.wait_for_save()
        sending, recving = worker.get_finished(set(scheduler_output.finished_req_ids))
        errors = worker.get_block_ids_with_load_errors()
        stats = worker.get_kv_connector_stats()
    finally:
        worker.clear_connector_metadata()
    return KVConnectorOutput(
        finished_sending=set(sending or ()),
        finished_recving=set(recving or ()),
        invalid_block_ids=set(errors),
        kv_connector_stats=stats or None,
    )


class ConnectorModelRunner(ScriptedModelRunner):
    """``ScriptedModelRunner`` plus a worker-role connector whose results ride on each ``ModelRunnerOutput``."""

    def __init__(self, worker: KVConnectorBase, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker = worker

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        output = super().execute(so)
        output.kv_connector_output = run_worker_connector(self.worker, so)
        return output
