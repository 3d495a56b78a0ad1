"""How many KV-cache blocks fit in a memory budget, and what to tell the user when too few do.

Pure arithmetic (no torch): the executor measures memory and the model's shape and calls these.
"""

from __future__ import annotations

import logging
import os

from vllite.exceptions import KVCacheMemoryError

logger = logging.getLogger(__name__)

GiB = 1 << 30

#: KV-cache space on the CPU when neither ``--cpu-kvcache-space`` nor ``VLLITE_CPU_KVCACHE_SPACE`` is given:
#: small enough to leave room for the model and the OS on a 24 GiB machine.
DEFAULT_CPU_KVCACHE_SPACE_GIB: float = 4.0
CPU_KVCACHE_SPACE_ENV = "VLLITE_CPU_KVCACHE_SPACE"


def kv_cache_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, v_head_dim: int | None = None
) -> int:
    """Bytes one token's K and V take across all layers (``v_head_dim``: the values' head size when it is not the
    keys', as in multi-head latent attention)."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("v_head_dim", v_head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return num_layers * num_kv_heads * (head_dim + v_head_dim) * dtype_bytes


def cpu_kvcache_space_bytes(configured_gib: float | None = None) -> int:
    """The CPU KV-cache budget: ``configured_gib`` (``--cpu-kvcache-space``), else ``VLLITE_CPU_KVCACHE_SPACE``
    in GiB, else ``DEFAULT_CPU_KVCACHE_SPACE_GIB``.
    """
    if configured_gib is None:
        env = os.environ.get(CPU_KVCACHE_SPACE_ENV, "").strip()
        if env:
            try:
                configured_gib = float(env)
            except ValueError:
                raise ValueError(f"{CPU_KVCACHE_SPACE_ENV}={env!r} is not a number of GiB") from None
        else:
            configured_gib = DEFAULT_CPU_KVCACHE_SPACE_GIB
    if configured_gib <= 0:
        raise ValueError(f"The CPU KV-cache space must be positive, got {configured_gib} GiB")
    return int(configured_gib * GiB)


def gpu_kvcache_space_bytes(total_memory: int, gpu_memory_utilization: float, non_kv_cache_memory: int) -> int:
    """The CUDA KV-cache budget: the engine's share of device memory (``--gpu-memory-utilization``) minus what
    the model weights and the profiled peak activations already take. Never negative.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return max(0, int(total_memory * gpu_memory_utilization) - non_kv_cache_memory)


def cuda_kvcache_space_bytes(
    total: int, free: int, free_at_start: int, peak_activations: int, gpu_memory_utilization: float
) -> int:
    """The KV-cache budget of an engine on a CUDA device: its share, ``gpu_memory_utilization x total``, less what
    it took since it started (``free_at_start - free``: weights, workspaces) and its profiled peak activations, and
    never more than is ``free``. Memory other processes held before the engine started is not counted against its
    share, so two engines can split one device (``0.45`` each)."""
    taken = max(0, free_at_start - free)
    return min(max(0, free), gpu_kvcache_space_bytes(total, gpu_memory_utilization, taken + peak_activations))


def _knobs(device: str | None) -> str:
    if device == "cpu":
        memory = f"raise --cpu-kvcache-space (or {CPU_KVCACHE_SPACE_ENV}, in GiB)"
    elif device == "cuda":
        memory = "raise --gpu-memory-utilization"
    else:
        memory = (
            f"raise --cpu-kvcache-space (or {CPU_KVCACHE_SPACE_ENV}, in GiB) on the CPU or "
            "--gpu-memory-utilization on CUDA"
        )
    return f"{memory}, or lower --max-model-len"


def determine_num_blocks(
    available_bytes: int,
    bytes_per_token: int,
    block_size: int,
    max_model_len: int,
    *,
    allow_shrink: bool = False,
    device: str | None = None,
) -> tuple[int, int]:
    """The number of blocks (including the null block) that fit in ``available_bytes``, and the context length
    to use.

    One sequence of ``max_model_len`` tokens must fit. If it does not, this raises ``KVCacheMemoryError``
    saying how much memory is needed and which knob to turn (``device`` picks the knob named); with
    ``allow_shrink`` it instead lowers ``max_model_len`` to what fits and logs a warning.
    """
    if bytes_per_token <= 0 or block_size <= 0 or max_model_len <= 0:
        raise ValueError(
            f"bytes_per_token ({bytes_per_token}), block_size ({block_size}) and max_model_len "
            f"({max_model_len}) must be positive"
        )
    bytes_per_block = bytes_per_token * block_size
    num_blocks = max(0, available_bytes) // bytes_per_block
    usable_blocks = max(0, num_blocks - 1)
    blocks_per_seq = -(-max_model_len // block_size)
    if usable_blocks >= blocks_per_seq:
        return num_blocks, max_model_len

    needed = (blocks_per_seq + 1) * bytes_per_block
    if allow_shrink and usable_blocks > 0:
        new_len = usable_blocks * block_size
        logger.warning(
            "The KV cache (%.2f GiB, %d usable blocks of %d tokens) cannot hold one sequence of max_model_len=%d "
            "tokens (needs %.2f GiB); lowering max_model_len to %d. To keep %d, %s.",
            available_bytes / GiB,
            usable_blocks,
            block_size,
            max_model_len,
            needed / GiB,
            new_len,
            max_model_len,
            _knobs(device).replace(", or lower --max-model-len", ""),
        )
        return num_blocks, new_len
    raise KVCacheMemoryError(
        f"The KV cache cannot hold one sequence of max_model_len={max_model_len} tokens: that needs "
        f"{needed / GiB:.2f} GiB ({blocks_per_seq} blocks of {block_size} tokens plus the null block, "
        f"{bytes_per_token} bytes per token), but only {max(0, available_bytes) / GiB:.2f} GiB are available "
        f"for it. To fix this, {_knobs(device)}."
    )
