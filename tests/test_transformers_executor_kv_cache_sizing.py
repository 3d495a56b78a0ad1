"""Sizing: bytes per token, blocks from a budget, the error that names the knobs, shrinking with a warning."""

from __future__ import annotations

import logging

import pytest

from vllite.exceptions import KVCacheMemoryError
from vllite.plugins.transformers_executor.kv_cache_sizing import (
    CPU_KVCACHE_SPACE_ENV,
    DEFAULT_CPU_KVCACHE_SPACE_GIB,
    cpu_kvcache_space_bytes,
    cuda_kvcache_space_bytes,
    determine_num_blocks,
    gpu_kvcache_space_bytes,
    kv_cache_bytes_per_token,
)

GiB = 1 << 30


def test_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    assert kv_cache_bytes_per_token(num_layers=2, num_kv_heads=4, head_dim=8, dtype_bytes=2) == 256
    with pytest.raises(ValueError, match="head_dim"):
        kv_cache_bytes_per_token(2, 4, 0, 2)


def test_num_blocks_includes_the_null_block() -> None:
    # 100 bytes/token, 16 tokens/block = 1600 bytes/block; 16_000 bytes = 10 blocks, 9 usable = 144 tokens.
    assert determine_num_blocks(16_000, 100, 16, 144) == (10, 144)
    assert determine_num_blocks(16_000 + 1599, 100, 16, 100) == (10, 100)


def test_too_small_a_budget_names_the_need_and_the_knobs(caplog: pytest.LogCaptureFixture) -> None:
    per_token = kv_cache_bytes_per_token(32, 8, 128, 2)  # 128 KiB, like an 8B model in bf16
    with pytest.raises(KVCacheMemoryError) as info:
        determine_num_blocks(1 * GiB, per_token, 16, 32768, device="cpu")
    msg = str(info.value)
    assert "max_model_len=32768" in msg and "4.00 GiB" in msg and "1.00 GiB" in msg
    assert "--cpu-kvcache-space" in msg and CPU_KVCACHE_SPACE_ENV in msg and "--max-model-len" in msg
    with pytest.raises(KVCacheMemoryError, match="--gpu-memory-utilization"):
        determine_num_blocks(1 * GiB, per_token, 16, 32768, device="cuda")
    with pytest.raises(KVCacheMemoryError, match=r"--cpu-kvcache-space.*--gpu-memory-utilization"):
        determine_num_blocks(1 * GiB, per_token, 16, 32768)
    assert isinstance(info.value, ValueError)


def test_shrinking_max_model_len_only_when_allowed_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllite.plugins.transformers_executor.kv_cache_sizing"):
        assert determine_num_blocks(16_000, 100, 16, 1000, allow_shrink=True) == (10, 144)
    assert "lowering max_model_len to 144" in caplog.text
    with pytest.raises(KVCacheMemoryError):
        determine_num_blocks(16_000, 100, 16, 1000)
    with pytest.raises(KVCacheMemoryError):  # not even one usable block
        determine_num_blocks(3000, 100, 16, 1000, allow_shrink=True)
    with pytest.raises(ValueError):
        determine_num_blocks(16_000, 0, 16, 10)


def test_cpu_space_default_env_and_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV, raising=False)
    assert cpu_kvcache_space_bytes() == int(DEFAULT_CPU_KVCACHE_SPACE_GIB * GiB)
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "1.5")
    assert cpu_kvcache_space_bytes() == int(1.5 * GiB)
    assert cpu_kvcache_space_bytes(2) == 2 * GiB
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "lots")
    with pytest.raises(ValueError, match=CPU_KVCACHE_SPACE_ENV):
        cpu_kvcache_space_bytes()
    with pytest.raises(ValueError):
        cpu_kvcache_space_bytes(0)


def test_gpu_space_is_the_share_minus_non_kv_memory() -> None:
    assert gpu_kvcache_space_bytes(80 * GiB, 0.9, 20 * GiB) == 52 * GiB
    assert gpu_kvcache_space_bytes(10 * GiB, 0.5, 8 * GiB) == 0
    with pytest.raises(ValueError):
        gpu_kvcache_space_bytes(10 * GiB, 1.5, 0)


def test_cuda_budget_is_the_engines_share_whatever_other_processes_hold() -> None:
    total = 80 * GiB
    # 6 GiB were in use before the engine started (another process, or this one's earlier work): not counted.
    free_at_start = 74 * GiB
    free = free_at_start - 2 * GiB  # the engine took 2 GiB (weights, workspaces)
    assert cuda_kvcache_space_bytes(total, free, free_at_start, GiB, 0.5) == 40 * GiB - 2 * GiB - GiB
    # Never more than is free, never negative.
    assert cuda_kvcache_space_bytes(total, 10 * GiB, 12 * GiB, 0, 0.9) == 10 * GiB
    assert cuda_kvcache_space_bytes(total, free, free_at_start, 10 * GiB, 0.05) == 0
    assert cuda_kvcache_space_bytes(total, -1, 0, 0, 0.5) == 0
