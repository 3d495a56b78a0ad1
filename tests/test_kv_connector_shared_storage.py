"""The ``shared-storage`` KV connector: block files, the two roles driven by hand against the executor, whole
engines (in-process and in the engine-core process) sharing a directory, damaged files, and a third-party
connector selected by registered name and by class path.

The oracle is Hugging Face ``generate()`` (greedy, float32): KV loaded from the directory must give the same
tokens as computing it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_connector_support import BLOCK, PROMPT, greedy, kv_llm
from kv_connector_support import model_path as model_path  # the fixture
from test_executor_support import (
    ManualScheduler,
    hf_greedy,
    make_config,
    make_model,
    single_thread,  # noqa: F401  (autouse fixture)
)

from tests.plugin_utils import forget_modules, make_distribution
from vllite.kv_connector.base import KVConnectorRole
from vllite.kv_connector.config import KVTransferConfig
from vllite.kv_connector.factory import connector_class, create_connector
from vllite.plugin_manager import reset_plugin_manager
from vllite.plugins.kv_connectors.block_files import SUFFIX, is_complete, read_block, write_block
from vllite.plugins.kv_connectors.errors import KVBlockFileError
from vllite.plugins.kv_connectors.shared_storage import SharedStorageConnector
from vllite.plugins.transformers_executor.executor import DefaultExecutor
from vllite.request import Request
from vllite.sampling_params import SamplingParams
from vllite.sched.output import ModelRunnerOutput, SchedulerOutput

SHARED = [*PROMPT[:16], 7, 19, 44, 50, 61, 25, 12, 95, 33]  # 4 blocks in common


def _kv_config(directory: Path, **kw: Any) -> KVTransferConfig:
    extra = {"shared_storage_path": str(directory)}
    return KVTransferConfig("shared-storage", kv_connector_extra_config=extra, **kw)


def _files(directory: Path) -> list[Path]:
    return sorted(directory.rglob(f"*{SUFFIX}"))


# ---------------------------------------------------------------------------------------------- block files
def test_block_file_round_trip_and_damage(tmp_path: Path) -> None:
    kv = torch.randn(2, 2, BLOCK, 2, 16)
    path = tmp_path / f"abc{SUFFIX}"
    write_block(path, kv)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temporary file was renamed, none is left
    assert is_complete(path)
    assert torch.equal(read_block(path, tuple(kv.shape), kv.dtype), kv)
    with pytest.raises(KVBlockFileError, match="this engine needs"):
        read_block(path, (3, 2, BLOCK, 2, 16), kv.dtype)
    with pytest.raises(KVBlockFileError, match="this engine needs"):
        read_block(path, tuple(kv.shape), torch.float16)

    raw = path.read_bytes()
    flipped = bytearray(raw)
    flipped[-5] ^= 0xFF
    path.write_bytes(bytes(flipped))
    assert is_complete(path)  # same length: only the checksum tells
    with pytest.raises(KVBlockFileError, match="checksum"):
        read_block(path, tuple(kv.shape), kv.dtype)

    for cut in (len(raw) - 1, 100, 4, 0):
        path.write_bytes(raw[:cut])
        assert not is_complete(path)
        with pytest.raises(KVBlockFileError):
            read_block(path, tuple(kv.shape), kv.dtype)
    assert not is_complete(tmp_path / "missing")
    with pytest.raises(KVBlockFileError, match="cannot be read"):
        read_block(tmp_path / "missing", tuple(kv.shape), kv.dtype)


def test_config_errors_name_the_field(model_path: Path) -> None:
    config = make_config(model_path)
    with pytest.raises(ValueError, match="shared_storage_path"):
        SharedStorageConnector(config, KVConnectorRole.SCHEDULER, KVTransferConfig("shared-storage"))
    assert connector_class(KVTransferConfig("shared-storage")) is SharedStorageConnector


# ------------------------------------------------------------------------------- both roles driven by hand
class ConnectorScheduler(ManualScheduler):
    """``ManualScheduler`` consulting a scheduler-role connector as the engine's scheduler does: the external hit
    on admission (blocks allocated for it), ``update_state_after_alloc``, the metadata on every step."""

    def __init__(self, connector: SharedStorageConnector, num_blocks: int = 64) -> None:
        super().__init__(BLOCK, num_blocks)
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.external: dict[str, int] = {}
        self.computed_prompt_tokens: dict[str, int] = {}

    def add(self, req_id: str, prompt: list[int], params: SamplingParams | None = None, max_tokens: int = 8) -> None:
        super().add(req_id, prompt, params, max_tokens)
        req = self.running[-1]
        request = self.requests[req_id] = Request(req_id, list(prompt), req.params)
        num_external, is_async = self.connector.get_num_new_matched_tokens(request, 0)
        assert num_external is not None and not is_async
        req.blocks = [self.free.pop(0) for _ in range(num_external // BLOCK)]
        req.num_computed = self.external[req_id] = num_external
        self.connector.update_state_after_alloc(request, list(req.blocks), num_external)

    def schedule(self, skip: set[str] = frozenset()) -> SchedulerOutput:
        so = super().schedule(skip)
        so.kv_connector_metadata = self.connector.build_connector_meta(so)
        for req in self.running:
            n = so.num_scheduled_tokens.get(req.req_id, 0)
            prompt_part = max(0, min(req.num_computed + n, len(req.prompt)) - req.num_computed)
            self.computed_prompt_tokens[req.req_id] = self.computed_prompt_tokens.get(req.req_id, 0) + prompt_part
        return so

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        if out.kv_connector_output is not None:
            self.connector.update_connector_output(out.kv_connector_output)
        super().update(so, out)

    def finish(self, req_id: str) -> None:
        self.connector.request_finished(self.requests[req_id], [])
        super().finish(req_id)


def _engine_pair(model_path: Path, directory: Path, **kw: Any) -> tuple[DefaultExecutor, ConnectorScheduler]:
    config = dataclasses.replace(
        make_config(model_path, block_size=BLOCK), kv_transfer_config=_kv_config(directory, **kw)
    )
    executor = DefaultExecutor(config)
    executor.initialize_kv_cache()
    scheduler_role = create_connector(config, KVConnectorRole.SCHEDULER, config.kv_transfer_config)
    assert isinstance(scheduler_role, SharedStorageConnector)
    return executor, ConnectorScheduler(scheduler_role)


def _worker(executor: DefaultExecutor) -> Any:
    connector = executor.runner.kv_connector
    assert isinstance(connector, SharedStorageConnector) and connector.worker is not None
    return connector.worker


def test_second_executor_loads_the_prefix_instead_of_computing_it(model_path: Path, tmp_path: Path) -> None:
    expected = hf_greedy(model_path, PROMPT, 6)
    executor, sched = _engine_pair(model_path, tmp_path)
    sched.add("a", PROMPT, max_tokens=6)
    assert sched.external["a"] == 0
    assert sched.run(executor)["a"] == expected
    assert len(_files(tmp_path)) == len(PROMPT) // BLOCK == 5  # every full prompt block, output blocks never
    assert _worker(executor).num_blocks_saved == 5
    executor.shutdown()

    executor, sched = _engine_pair(model_path, tmp_path)  # a "restarted" engine on the same directory
    sched.add("a", PROMPT, max_tokens=6)
    sched.add("b", SHARED, max_tokens=6)
    assert sched.external == {"a": 20, "b": 16}  # never the last prompt token; only the shared blocks
    done = sched.run(executor)
    assert done["a"] == expected
    assert done["b"] == hf_greedy(model_path, SHARED, 6)
    assert sched.computed_prompt_tokens == {"a": len(PROMPT) - 20, "b": len(SHARED) - 16}
    worker = _worker(executor)
    assert worker.num_blocks_loaded == 5 + 4 and worker.num_load_errors == 0
    assert worker.num_blocks_saved == 2  # b's own full blocks: 25 tokens = 6 blocks, 4 were stored
    assert len(_files(tmp_path)) == 7
    executor.shutdown()


def test_truncated_file_is_a_miss_and_corrupt_one_a_reported_load_error(model_path: Path, tmp_path: Path) -> None:
    expected = hf_greedy(model_path, PROMPT, 4)
    executor, sched = _engine_pair(model_path, tmp_path)
    sched.add("a", PROMPT, max_tokens=4)
    sched.run(executor)
    executor.shutdown()
    scheduler_role = sched.connector
    names = scheduler_role.prefix_blocks.track(Request("x", PROMPT, SamplingParams())).names
    paths = [scheduler_role.directory / f"{name}{SUFFIX}" for name in names]
    assert all(p.exists() for p in paths)

    # Block 3 truncated: the scheduler sees a 3-block prefix, the output is still HF's, and block 3 is re-saved.
    raw = paths[3].read_bytes()
    paths[3].write_bytes(raw[: len(raw) // 2])
    executor, sched = _engine_pair(model_path, tmp_path)
    sched.add("a", PROMPT, max_tokens=4)
    assert sched.external["a"] == 12
    assert sched.run(executor)["a"] == expected
    assert is_complete(paths[3])
    executor.shutdown()

    # Block 2 corrupt (same length): the scheduler promises 5 blocks, the worker refuses blocks 2.. and reports
    # them, never writes KV computed on top of them, and removes the bad file.
    damaged = bytearray(paths[2].read_bytes())
    damaged[-3] ^= 0x55
    paths[2].write_bytes(bytes(damaged))
    executor, sched = _engine_pair(model_path, tmp_path)
    sched.add("a", PROMPT, max_tokens=4)
    assert sched.external["a"] == 20
    so = sched.schedule()
    out = executor.execute_model(so)
    assert out.kv_connector_output is not None
    [load] = so.kv_connector_metadata.loads
    assert out.kv_connector_output.invalid_block_ids == set(load.block_ids[2:])
    assert _worker(executor).num_blocks_loaded == 2 and _worker(executor).num_load_errors == 3
    assert not paths[2].exists()
    executor.shutdown()


def test_producer_only_saves_and_consumer_only_loads(model_path: Path, tmp_path: Path) -> None:
    executor, sched = _engine_pair(model_path, tmp_path, kv_role="kv_consumer")
    sched.add("a", PROMPT, max_tokens=2)
    sched.run(executor)
    assert _files(tmp_path) == []
    executor.shutdown()
    executor, sched = _engine_pair(model_path, tmp_path, kv_role="kv_producer")
    sched.add("a", PROMPT, max_tokens=2)
    sched.run(executor)
    assert len(_files(tmp_path)) == 5
    sched.add("b", PROMPT, max_tokens=2)  # a producer never loads
    assert sched.external["b"] == 0
    executor.shutdown()


def test_namespace_separates_models_and_salts_separate_prefixes(model_path: Path, tmp_path: Path) -> None:
    config = make_config(model_path, block_size=BLOCK)
    a = SharedStorageConnector(config, KVConnectorRole.SCHEDULER, _kv_config(tmp_path))
    other = dataclasses.replace(config, model_config=dataclasses.replace(config.model_config, dtype="bfloat16"))
    b = SharedStorageConnector(other, KVConnectorRole.SCHEDULER, _kv_config(tmp_path))
    assert a.directory != b.directory and a.directory.parent == tmp_path
    shared = KVTransferConfig(
        "shared-storage", kv_connector_extra_config={"shared_storage_path": str(tmp_path), "namespace": "team"}
    )
    assert SharedStorageConnector(other, KVConnectorRole.SCHEDULER, shared).directory == tmp_path / "team"
    plain = a.prefix_blocks.track(Request("p", PROMPT, SamplingParams())).names
    salted = a.prefix_blocks.track(Request("s", PROMPT, SamplingParams(), cache_salt="x")).names
    assert len(plain) == 5 and not set(plain) & set(salted)


# -------------------------------------------------------------------------------------------- whole engines
def _llm(model_path: Path, directory: Path, **kw: Any) -> Any:
    kv = {"kv_connector": "shared-storage", "kv_connector_extra_config": {"shared_storage_path": str(directory)}}
    kv.update(kw.pop("kv", {}))
    settings: dict[str, Any] = {"max_model_len": 128, "num_gpu_blocks_override": 64, **kw}
    return kv_llm(model_path, kv, **settings)


def _executor_of(llm: Any) -> DefaultExecutor:
    return llm.llm_engine.engine_core.engine_core.model_executor


@pytest.mark.parametrize("multiprocess", ["0", "1"], ids=["in-process", "engine-core-process"])
def test_second_engine_reuses_the_directory(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, multiprocess: str
) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", multiprocess)
    expected = {"shared": hf_greedy(model_path, SHARED, 6), "prompt": hf_greedy(model_path, PROMPT, 6)}
    with _llm(model_path, tmp_path) as first:
        [out] = greedy(first, [PROMPT])
    assert out.outputs[0].token_ids == expected["prompt"]
    assert len(_files(tmp_path)) == 5
    with _llm(model_path, tmp_path) as second:  # a fresh engine: an empty prefix cache, the same directory
        [shared] = greedy(second, [SHARED])  # 4 blocks from the directory
        [again] = greedy(second, [PROMPT])  # 4 blocks from the local prefix cache, the 5th from the directory
        if multiprocess == "0":
            worker = _worker(_executor_of(second))
            assert worker.num_blocks_loaded == 5 and worker.num_load_errors == 0
    assert shared.outputs[0].token_ids == expected["shared"]
    assert again.outputs[0].token_ids == expected["prompt"]
    # The loaded prefix counts as cached: only the rest of each prompt was computed.
    assert shared.num_cached_tokens == 16
    assert again.num_cached_tokens == 20


def test_sliding_window_model_with_chunked_prefill(tmp_path: Path) -> None:
    model = make_model("mistral", tmp_path / "mistral", sliding_window=6)
    expected = hf_greedy(model, PROMPT, 6)
    for run in range(2):  # blocks are saved chunk by chunk, before the window drops them; then loaded
        with _llm(model, tmp_path / "kv", max_num_batched_tokens=8) as llm:
            [out] = greedy(llm, [PROMPT])
            worker = _worker(_executor_of(llm))
        assert out.outputs[0].token_ids == expected
        assert (worker.num_blocks_saved, worker.num_blocks_loaded, out.num_cached_tokens) == (
            (5, 0, 0) if run == 0 else (0, 5, 20)
        )


def test_preemptions_with_a_small_cache_and_shared_prefixes(model_path: Path, tmp_path: Path) -> None:
    import random

    rng = random.Random(5)
    prompts = [PROMPT[:16] + [rng.randrange(3, 90) for _ in range(rng.randint(5, 24))] for _ in range(8)]
    expected = [hf_greedy(model_path, p, 6) for p in prompts]
    for run in range(2):
        with _llm(model_path, tmp_path, num_gpu_blocks_override=24, max_model_len=88, max_num_seqs=8) as llm:
            outs = greedy(llm, prompts)
            preemptions = llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions_total
            worker = _worker(_executor_of(llm))
        assert [o.outputs[0].token_ids for o in outs] == expected, f"run {run}"
        assert preemptions > 0, "the small KV cache was meant to force preemptions"
        assert worker.num_load_errors == 0
        if run == 1:
            assert worker.num_blocks_saved == 0 and all(o.num_cached_tokens >= 16 for o in outs)


def _block_paths(model_path: Path, directory: Path, prompt: list[int]) -> list[Path]:
    role = SharedStorageConnector(
        make_config(model_path, block_size=BLOCK), KVConnectorRole.SCHEDULER, _kv_config(directory)
    )
    return [
        role.directory / f"{name}{SUFFIX}"
        for name in role.prefix_blocks.track(Request("x", prompt, SamplingParams())).names
    ]


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_file_is_never_loaded_and_output_equals_hf(model_path: Path, tmp_path: Path, damage: str) -> None:
    expected = hf_greedy(model_path, PROMPT, 6)
    with _llm(model_path, tmp_path) as first:
        greedy(first, [PROMPT])
    paths = _block_paths(model_path, tmp_path, PROMPT)
    assert all(is_complete(p) for p in paths)
    raw = bytearray(paths[2].read_bytes())
    if damage == "truncate":
        paths[2].write_bytes(raw[:-10])
    else:
        raw[-1] ^= 0xFF
        paths[2].write_bytes(bytes(raw))
    with _llm(model_path, tmp_path, kv={"kv_load_failure_policy": "recompute"}) as second:
        [out] = greedy(second, [PROMPT])
        worker = _worker(_executor_of(second))
        # Truncated: a miss when scheduling (2 blocks load). Corrupt: blocks 2.. fail their load and recompute.
        assert (worker.num_blocks_loaded, worker.num_load_errors) == ((2, 0) if damage == "truncate" else (2, 3))
    assert out.outputs[0].token_ids == expected
    if damage == "truncate":
        assert out.num_cached_tokens == 8
    assert is_complete(paths[2])  # computed again and stored again


def test_corrupt_file_under_the_fail_policy_fails_the_request(model_path: Path, tmp_path: Path) -> None:
    with _llm(model_path, tmp_path) as first:
        greedy(first, [PROMPT])
    path = _block_paths(model_path, tmp_path, PROMPT)[1]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with _llm(model_path, tmp_path, kv={"kv_load_failure_policy": "fail"}) as second:
        [out] = greedy(second, [PROMPT])
        assert out.outputs[0].finish_reason == "error"
        [ok] = greedy(second, [SHARED])  # the engine goes on; block 1 is gone from the directory now
    assert ok.outputs[0].token_ids == hf_greedy(model_path, SHARED, 6)


# ------------------------------------------------------------------------------------- a third-party connector
THIRD_PARTY = """
from vllite.hookspecs import hookimpl
from vllite.plugins.kv_connectors.shared_storage import SharedStorageConnector


class CountingStorage(SharedStorageConnector):
    built = []

    def __init__(self, config, role, kv_transfer_config):
        super().__init__(config, role, kv_transfer_config)
        CountingStorage.built.append(role.name)


@hookimpl
def vllite_register_kv_connectors(register):
    register("counting-storage", CountingStorage)
"""


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = make_distribution(
        tmp_path / "site", "throwaway-kv-connector", {"vllite": {"tw_kv": "tw_kv_mod"}}, {"tw_kv_mod": THIRD_PARTY}
    )
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("VLLITE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("VLLITE_PLUGINS", raising=False)
    reset_plugin_manager()
    yield root
    forget_modules("tw_kv_mod")
    reset_plugin_manager()


@pytest.mark.parametrize("how", ["name", "class-path"])
def test_third_party_connector_by_name_and_by_class_path(
    model_path: Path, tmp_path: Path, third_party: Path, how: str
) -> None:
    import importlib

    selection: dict[str, Any] = {"kv_connector": "counting-storage"}
    if how == "class-path":
        selection = {"kv_connector": "CountingStorage", "kv_connector_module_path": "tw_kv_mod"}
    module = importlib.import_module("tw_kv_mod")
    config = KVTransferConfig(kv_connector_extra_config={"shared_storage_path": str(tmp_path / "kv")}, **selection)
    assert connector_class(config) is module.CountingStorage
    directory = tmp_path / "kv"
    expected = hf_greedy(model_path, PROMPT, 4)
    with _llm(model_path, directory, kv=selection) as first:
        [out] = greedy(first, [PROMPT], 4)
    assert out.outputs[0].token_ids == expected
    assert sorted(module.CountingStorage.built) == ["SCHEDULER", "WORKER"]
    assert len(_files(directory)) == 5
    with _llm(model_path, directory, kv=selection) as second:
        [out] = greedy(second, [PROMPT], 4)
    assert out.outputs[0].token_ids == expected and out.num_cached_tokens == 20
    assert os.path.isdir(directory)
