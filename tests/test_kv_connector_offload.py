"""The ``offload`` KV connector: the host-memory tier's LRU bound, the conformance kit, and whole engines
(in-process and in the engine-core process) whose KV cache is too small to keep a prefix, which comes back from
the tier asynchronously instead of being recomputed.

The oracle is Hugging Face ``generate()`` (greedy, float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kv_connector_support import BLOCK, PROMPT, greedy, kv_llm
from kv_connector_support import model_path as model_path  # the fixture
from test_executor_support import (
    hf_greedy,
    make_config,
    single_thread,  # noqa: F401  (autouse fixture)
)

from vllite.engine_args_checks import kv_transfer_config
from vllite.kv_connector.base import KVConnectorRole
from vllite.kv_connector.config import KVTransferConfig
from vllite.kv_connector.factory import connector_class
from vllite.plugins.kv_connectors.offload import OffloadConnector
from vllite.plugins.kv_connectors.offload_worker import BlockTransfer, OffloadWorker
from vllite.testing.kv_connector_conformance import run_conformance

# Other traffic: distinct prompts that, through a 12-block cache, push PROMPT's blocks out of the prefix cache.
OTHERS = [[(7 * i + 13 * j) % 90 + 3 for j in range(30)] for i in range(1, 4)]


# ------------------------------------------------------------------------------------------------ the tier
def _fake_caches(num_blocks: int = 8) -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.randn(2, num_blocks, BLOCK, 2, 8) for i in range(2)}


def _save(worker: OffloadWorker, caches: dict[str, torch.Tensor], block_ids: list[int], names: list[str]) -> None:
    saves = [BlockTransfer("r", block_ids, names)]
    for name, layer in caches.items():
        worker.save_layer(name, layer, saves)
    worker.finish_saves()


def test_tier_is_an_lru_bounded_by_bytes() -> None:
    caches = _fake_caches()
    block_bytes = 2 * 2 * BLOCK * 2 * 8 * 4
    worker = OffloadWorker(capacity_bytes=3 * block_bytes)
    worker.register(caches)
    _save(worker, caches, [1, 2, 3], ["a", "b", "c"])
    assert worker.take_changes() == {"stored": ["a", "b", "c"], "evicted": []}
    worker.start_load([BlockTransfer("load", [5], ["a"])])  # a load refreshes "a": "b" is now the oldest
    worker.loads.wait_idle()
    assert worker.loads.take_finished() == {"load"} and worker.loads.take_load_errors() == set()
    assert all(torch.equal(layer[:, 5], layer[:, 1]) for layer in caches.values())
    _save(worker, caches, [4, 6], ["d", "e"])
    assert list(worker.tier) == ["a", "d", "e"]
    assert worker.bytes_used == 3 * block_bytes <= worker.capacity_bytes
    assert worker.take_changes() == {"stored": ["d", "e"], "evicted": ["b", "c"]}
    assert worker.take_changes() is None
    # A block the tier no longer holds is a load error for it and what follows; the request is still reported.
    worker.start_load([BlockTransfer("gone", [6, 7], ["a", "b"])])
    worker.loads.wait_idle()
    assert worker.loads.take_finished() == {"gone"} and worker.loads.take_load_errors() == {7}
    worker.shutdown()


def test_disk_layer_takes_what_memory_evicts(tmp_path: Path) -> None:
    from vllite.plugins.kv_connectors.offload_disk import DiskTier

    caches = _fake_caches()
    block_bytes = 2 * 2 * BLOCK * 2 * 8 * 4
    disk = DiskTier(tmp_path / "spill", capacity_bytes=2 * block_bytes)
    worker = OffloadWorker(capacity_bytes=block_bytes, disk=disk)
    worker.register(caches)
    _save(worker, caches, [1, 2, 3], ["a", "b", "c"])
    assert list(worker.tier) == ["c"] and list(disk.files) == ["a", "b"]
    assert worker.take_changes() == {"stored": ["a", "b", "c"], "evicted": []}  # spilled, not gone
    worker.start_load([BlockTransfer("load", [5, 6], ["a", "c"])])  # "a" from disk, "c" from memory
    worker.loads.wait_idle()
    assert worker.loads.take_finished() == {"load"} and worker.loads.take_load_errors() == set()
    for layer in caches.values():
        assert torch.equal(layer[:, 5], layer[:, 1]) and torch.equal(layer[:, 6], layer[:, 3])
    assert disk.num_blocks_read == 1
    _save(worker, caches, [4], ["d"])  # "c" spills; the disk layer drops its least recently used, "b"
    assert list(worker.tier) == ["d"] and list(disk.files) == ["a", "c"]
    assert worker.take_changes() == {"stored": ["d"], "evicted": ["b"]}
    # A corrupt file is a miss: a load error for it and what follows, and the name leaves the tier.
    disk.read("a", (2, 2, BLOCK, 2, 8), torch.float32).result()  # the writes have landed
    path = disk.path / "a.safetensors"
    path.write_bytes(path.read_bytes()[:-7] + b"garbage")
    worker.start_load([BlockTransfer("bad", [6, 7], ["a", "c"])])
    worker.loads.wait_idle()
    assert worker.loads.take_finished() == {"bad"} and worker.loads.take_load_errors() == {6, 7}
    assert worker.take_changes() == {"stored": [], "evicted": ["a"]}
    folder = disk.path
    worker.shutdown()
    assert not folder.exists()


def test_config_and_flag(model_path: Path) -> None:
    assert connector_class(KVTransferConfig("offload")) is OffloadConnector
    config = make_config(model_path)
    for bad in (0, -1, "big", True):
        with pytest.raises(ValueError, match="offload_size_gib"):
            OffloadConnector(
                config,
                KVConnectorRole.SCHEDULER,
                KVTransferConfig("offload", kv_connector_extra_config={"offload_size_gib": bad}),
            )
    bad_disk = [({"offload_dir": 3}, "offload_dir"), ({"offload_dir": "/tmp", "offload_disk_size_gib": 0}, "disk_size")]
    for extra, field in bad_disk:
        with pytest.raises(ValueError, match=field):
            OffloadConnector(
                config, KVConnectorRole.SCHEDULER, KVTransferConfig("offload", kv_connector_extra_config=extra)
            )
    kv = kv_transfer_config(None, kv_offload_size=0.25)  # what EngineArgs(kv_offload_size=0.25) makes
    assert kv is not None and kv.kv_connector == "offload"
    assert kv.get_from_extra_config("offload_size_gib") == 0.25
    with pytest.raises(ValueError, match="kv_offload_size"):
        kv_transfer_config(None, kv_offload_size=0)
    explicit = kv_transfer_config('{"kv_connector": "x"}', kv_offload_size=1)
    assert explicit is not None and explicit.kv_connector == "x"


# ------------------------------------------------------------------------------------------- whole engines
def _llm(model_path: Path, size_gib: float = 0.01, offload_dir: Path | None = None, **kw: Any) -> Any:
    extra: dict[str, Any] = {"offload_size_gib": size_gib}
    if offload_dir is not None:
        extra.update(offload_dir=str(offload_dir), offload_disk_size_gib=0.01)
    kv = {"kv_connector": "offload", "kv_connector_extra_config": extra}
    settings: dict[str, Any] = {"max_model_len": 48, "num_gpu_blocks_override": 13, **kw}
    return kv_llm(model_path, kv, **settings)


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _run_evict_reload(llm: Any) -> tuple[Any, Any]:
    """PROMPT, other traffic one request at a time (evicting PROMPT from the prefix cache), PROMPT again."""
    [first] = greedy(llm, [PROMPT])
    for other in OTHERS:
        greedy(llm, [other])
    [again] = greedy(llm, [PROMPT])
    return first, again


@pytest.mark.parametrize("multiprocess", ["0", "1"], ids=["in-process", "engine-core-process"])
def test_evicted_prefix_is_loaded_from_the_tier_not_recomputed(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, multiprocess: str
) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", multiprocess)
    expected = hf_greedy(model_path, PROMPT, 6)
    with _llm(model_path) as llm:
        first, again = _run_evict_reload(llm)
        if multiprocess == "0":
            core = _core(llm)
            scheduler_role = core.scheduler.kv_transfer.connector
            worker = core.model_executor.runner.kv_connector.worker
            assert scheduler_role.num_loads == 1 and scheduler_role.num_loaded_tokens == 20
            assert worker.loads.num_blocks_loaded == 5 and worker.loads.num_load_errors == 0
            assert core.scheduler.kv_cache_manager.usage == 0  # idle: no block leaked
            assert not core.scheduler.kv_transfer.remote_loads and not core.scheduler.kv_transfer.held
    assert first.outputs[0].token_ids == expected and first.num_cached_tokens == 0
    assert again.outputs[0].token_ids == expected
    # 5 blocks came back from the tier: only the last 3 prompt tokens were computed.
    assert again.num_cached_tokens == 20


@pytest.mark.parametrize("multiprocess", ["0", "1"], ids=["in-process", "engine-core-process"])
def test_evicted_prefix_comes_back_from_the_disk_layer(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, multiprocess: str
) -> None:
    """A memory layer too small for one block: every block goes to disk, and the evicted prefix is read back."""
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", multiprocess)
    with _llm(model_path, size_gib=1e-9, offload_dir=tmp_path) as llm:
        first, again = _run_evict_reload(llm)
        if multiprocess == "0":
            worker = _core(llm).model_executor.runner.kv_connector.worker
            assert not worker.tier and worker.disk.num_blocks_read == 5 and worker.loads.num_load_errors == 0
        assert len(list(tmp_path.iterdir())) == 1  # the engine's private folder
    assert not list(tmp_path.iterdir())  # removed at shutdown
    assert again.num_cached_tokens == 20
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(model_path, PROMPT, 6)


def test_without_the_tier_the_prefix_is_recomputed(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same traffic with a tier too small for one block evicts PROMPT and recomputes it."""
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    with _llm(model_path, size_gib=1e-9) as llm:
        first, again = _run_evict_reload(llm)
        worker = _core(llm).model_executor.runner.kv_connector.worker
        assert not worker.tier and worker.loads.num_blocks_loaded == 0
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(model_path, PROMPT, 6)


def test_lru_bound_holds_in_the_engine(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    with _llm(model_path) as llm:  # measure one block's bytes
        greedy(llm, [PROMPT])
        block_bytes = _core(llm).model_executor.runner.kv_connector.worker.bytes_used // 5
    capacity = 3 * block_bytes
    with _llm(model_path, size_gib=capacity / 2**30) as llm:
        first, again = _run_evict_reload(llm)
        core = _core(llm)
        worker = core.model_executor.runner.kv_connector.worker
        scheduler_role = core.scheduler.kv_transfer.connector
        assert worker.bytes_used <= worker.capacity_bytes and len(worker.tier) == 3
        assert worker.num_blocks_evicted == worker.num_blocks_saved - 3
        assert scheduler_role.held == set(worker.tier)  # the scheduler's view follows the worker's reports
        assert core.scheduler.kv_cache_manager.usage == 0
    # PROMPT's first blocks were evicted from the tier by the other traffic: its chain is gone, it is recomputed.
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(model_path, PROMPT, 6)


def test_many_requests_sharing_a_prefix_through_a_small_cache(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrent requests, preemptions and loads together: every output equals HF, no block leaks."""
    import random

    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    rng = random.Random(3)
    prompts = [PROMPT[:16] + [rng.randrange(3, 90) for _ in range(rng.randint(5, 20))] for _ in range(6)]
    prompts += OTHERS
    expected = [hf_greedy(model_path, p, 6) for p in prompts]
    with _llm(model_path, num_gpu_blocks_override=24, max_model_len=48, max_num_seqs=4) as llm:
        for _ in range(2):
            outs = greedy(llm, prompts)
            assert [o.outputs[0].token_ids for o in outs] == expected
        core = _core(llm)
        worker = core.model_executor.runner.kv_connector.worker
        assert worker.loads.num_blocks_loaded > 0 and worker.loads.num_load_errors == 0
        assert core.scheduler.num_preemptions_total > 0, "the small KV cache was meant to force preemptions"
        assert all(o.num_cached_tokens >= 16 for o in outs)  # the second pass found every shared prefix
        assert core.scheduler.kv_cache_manager.usage == 0


def test_offload_passes_the_conformance_kit() -> None:
    """The kit's second pass resets the prefix cache, so every shared prefix comes back from the tier, async."""
    report = run_conformance({"kv_connector": "offload", "kv_connector_extra_config": {"offload_size_gib": 0.01}})
    assert report.num_external_tokens > 0 and report.num_async_loads > 0
