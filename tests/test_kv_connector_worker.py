"""The worker side of KV connectors in the default executor: the per-step call order, per-layer calls inside paged
attention, results on ``ModelRunnerOutput.kv_connector_output``, and nothing at all without a connector."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_connector_support import model_path as model_path  # the fixture
from test_executor_support import (
    ManualScheduler,
    hf_greedy,
    make_config,
    single_thread,  # noqa: F401  (autouse fixture)
)

from vllite.config import EngineConfig
from vllite.hookspecs import hookimpl
from vllite.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from vllite.kv_connector.config import KVTransferConfig
from vllite.plugin_manager import get_plugin_manager, reset_plugin_manager
from vllite.plugins.transformers_executor.attention import kv_layer_name
from vllite.plugins.transformers_executor.executor import DefaultExecutor
from vllite.sched.output import SchedulerOutput

NUM_LAYERS = 2


@dataclasses.dataclass
class StepMeta(KVConnectorMetadata):
    step: int


class RecordingConnector(KVConnectorBase):
    """Records every worker-role call; reports request ``done`` as finished sending and block 3 as failed."""

    instances: list[RecordingConnector] = []

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        super().__init__(config, role, kv_transfer_config)
        self.calls: list[tuple[Any, ...]] = []
        self.registered: dict[str, torch.Tensor] = {}
        RecordingConnector.instances.append(self)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.registered = dict(kv_caches)
        self.calls.append(("register", tuple(kv_caches)))

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        self.calls.append(("bind", getattr(metadata, "step", None)))

    def start_load_kv(self, **kwargs: Any) -> None:
        self.calls.append(("start_load", getattr(self.connector_metadata, "step", None)))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_layer", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        assert kv_layer.data_ptr() == self.registered[layer_name].data_ptr()
        assert "attn_metadata" in kwargs
        self.calls.append(("save_layer", layer_name))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_save",))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.calls.append(("get_finished", frozenset(finished_req_ids)))
        return (set(finished_req_ids) & {"done"}) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append(("load_errors",))
        return {3} if len([c for c in self.calls if c[0] == "bind"]) == 1 else set()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.calls.append(("clear",))

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))


class _Plugin:
    @staticmethod
    @hookimpl
    def vllite_register_kv_connectors(register: Any) -> None:
        register("recording", RecordingConnector)


@pytest.fixture
def recording():
    reset_plugin_manager()
    get_plugin_manager().register(_Plugin(), "recording-connector")
    RecordingConnector.instances.clear()
    yield
    reset_plugin_manager()


def _executor(model_path: Path, kv_transfer_config: KVTransferConfig | None) -> DefaultExecutor:
    config = dataclasses.replace(make_config(model_path), kv_transfer_config=kv_transfer_config)
    executor = DefaultExecutor(config)
    executor.initialize_kv_cache()
    return executor


def test_per_step_order_layers_and_output(model_path: Path, recording: None) -> None:
    executor = _executor(model_path, KVTransferConfig("recording"))
    [connector] = RecordingConnector.instances
    assert connector.role == KVConnectorRole.WORKER
    names = tuple(kv_layer_name(i) for i in range(NUM_LAYERS))
    assert connector.calls == [("register", names)]
    assert connector.registered[names[0]].shape[0] == 2  # [2, num_blocks, block_size, heads, dim]

    sched = ManualScheduler(4, 64)
    sched.add("a", [5, 6, 7, 8, 9, 10], max_tokens=2)
    so = sched.schedule()
    so.kv_connector_metadata = StepMeta(1)
    connector.calls.clear()
    out = executor.execute_model(so)
    sched.update(so, out)
    layer_calls = [c for name in names for c in (("wait_layer", name), ("save_layer", name))]
    assert connector.calls == [
        ("bind", 1),
        ("start_load", 1),
        *layer_calls,
        ("wait_save",),
        ("get_finished", frozenset()),
        ("load_errors",),
        ("clear",),
    ]
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == {3}

    # A step with nothing scheduled still reports (async transfers), without metadata from the scheduler.
    connector.calls.clear()
    empty = SchedulerOutput.make_empty()
    empty.finished_req_ids = {"done", "other"}
    out = executor.execute_model(empty)
    assert [c[0] for c in connector.calls] == [
        "bind",
        "start_load",
        "wait_save",
        "get_finished",
        "load_errors",
        "clear",
    ]
    assert ("get_finished", frozenset({"done", "other"})) in connector.calls
    assert out.kv_connector_output is not None and out.kv_connector_output.finished_sending == {"done"}

    # Nothing to report: no output object.
    so = sched.schedule()
    out = executor.execute_model(so)
    assert out.kv_connector_output is None

    executor.shutdown()
    assert connector.calls[-1] == ("shutdown",)


def test_metadata_is_cleared_when_the_step_fails(model_path: Path, recording: None) -> None:
    executor = _executor(model_path, KVTransferConfig("recording"))
    [connector] = RecordingConnector.instances
    sched = ManualScheduler(4, 64)
    sched.add("a", [5, 6, 7])
    bad = sched.schedule()
    bad.num_scheduled_tokens["a"] = bad.total_num_scheduled_tokens = 10  # past the known tokens
    bad.kv_connector_metadata = StepMeta(7)
    with pytest.raises(ValueError, match="past its known tokens"):
        executor.execute_model(bad)
    assert connector.calls[-1] == ("clear",)
    assert not connector.has_connector_metadata()
    executor.shutdown()


def test_sleep_and_wake_up_registers_the_new_cache(model_path: Path, recording: None) -> None:
    executor = _executor(model_path, KVTransferConfig("recording"))
    [connector] = RecordingConnector.instances
    executor.sleep(1)
    executor.wake_up()
    assert [c[0] for c in connector.calls] == ["register", "register"]
    assert len(RecordingConnector.instances) == 1  # built once
    sched = ManualScheduler(4, 64)
    prompt = [3, 14, 15, 92, 65, 35, 89]
    sched.add("a", prompt, max_tokens=4)
    assert sched.run(executor)["a"] == hf_greedy(model_path, prompt, 4)
    executor.shutdown()


def test_no_connector_no_calls(model_path: Path) -> None:
    executor = _executor(model_path, None)
    assert executor.runner.kv_connector is None
    sched = ManualScheduler(4, 64)
    prompt = [7, 1, 8, 2, 8, 1, 8, 2, 8]
    sched.add("a", prompt, max_tokens=3)
    assert sched.run(executor)["a"] == hf_greedy(model_path, prompt, 3)
    assert all(out.kv_connector_output is None for out in sched.outputs)
    executor.shutdown()
