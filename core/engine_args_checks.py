"""The checks of ``EngineArgs.create_engine_config``: each bad argument is a ``ValueError`` naming it, raised before
anything is loaded. What only a component can tell (``--async-scheduling`` with a feature it does not serve yet) that
component checks itself when the engine is created."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllite.config import DP_ROUTINGS, DTYPES, HASH_ALGOS, KV_CACHE_DTYPES, LOGPROBS_MODES

if TYPE_CHECKING:
    from vllite.engine_args import EngineArgs
    from vllite.kv_connector.config import KVTransferConfig


def validate_engine_args(args: EngineArgs) -> None:
    """Checks every argument on its own and the combinations ``EngineArgs`` alone can tell; ``ValueError``."""
    _check_choices(args)
    _check_logprobs_mode(args)
    if args.dp_routing not in DP_ROUTINGS:
        raise ValueError(f"dp_routing must be one of {', '.join(DP_ROUTINGS)}, got {args.dp_routing!r}.")
    for name in ("block_size", "max_num_seqs", "batch_queue_depth", "stream_interval", "data_parallel_size"):
        _positive(name, getattr(args, name))
    for name in ("max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) is not None:
            _positive(name, getattr(args, name))
    if args.long_prefill_token_threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be >= 0, got {args.long_prefill_token_threshold}.")
    _check_admission_limits(args)
    watermark = args.watermark
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a number in [0, 1) (a fraction of the KV blocks), got {watermark!r}.")
    if not isinstance(args.scheduler_reserve_full_isl, bool):
        raise ValueError(f"scheduler_reserve_full_isl must be True or False, got {args.scheduler_reserve_full_isl!r}.")
    if args.enable_return_routed_experts and (args.speculative_config or args.async_scheduling):
        raise ValueError(
            "--enable-return-routed-experts cannot be combined with --speculative-config or --async-scheduling: "
            "the routing of draft and placeholder positions is not kept; turn one of them off."
        )
    if args.gpu_memory_utilization is not None and not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}.")
    if args.scheduler_cls is None:
        # Policies are plugins: any registered scheduler name is a valid --scheduling-policy.
        from vllite.plugin_manager import get_registry

        policies = get_registry("schedulers")
        if args.scheduling_policy not in policies:
            raise ValueError(
                f"scheduling_policy must be a registered scheduler ({', '.join(sorted(policies))}), "
                f"got {args.scheduling_policy!r}."
            )


def cpu_kvcache_space_gib(value: float | None) -> float:
    """``value`` (``--cpu-kvcache-space``), else ``$VLLITE_CPU_KVCACHE_SPACE``, else 4 GiB; ``ValueError`` unless
    > 0."""
    cpu_space = float(os.environ.get("VLLITE_CPU_KVCACHE_SPACE", "4")) if value is None else value
    if cpu_space <= 0:
        raise ValueError(f"cpu_kvcache_space (VLLITE_CPU_KVCACHE_SPACE) must be > 0 GiB, got {cpu_space}.")
    return cpu_space


def kv_transfer_config(value: Any, kv_offload_size: float | None) -> KVTransferConfig | None:
    """``--kv-transfer-config`` (a ``KVTransferConfig``, a dict or JSON text) checked, else the ``offload``
    connector of ``--kv-offload-size`` GiB; ``ValueError`` naming the bad field."""
    from vllite.kv_connector.config import KVTransferConfig

    if value is None and kv_offload_size is not None:
        if not kv_offload_size > 0:
            raise ValueError(f"kv_offload_size must be > 0 GiB, got {kv_offload_size}.")
        extra = {"offload_size_gib": float(kv_offload_size)}
        return KVTransferConfig("offload", kv_role="kv_both", kv_connector_extra_config=extra)
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if not isinstance(value, (str, dict)):
        raise ValueError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}.")
    try:
        return KVTransferConfig.from_json(value)
    except TypeError as exc:  # a field of the wrong type the dataclass refused
        raise ValueError(f"kv_transfer_config is invalid: {exc}.") from None


def _check_choices(args: EngineArgs) -> None:
    """The dtypes and hash algorithm, and the data-parallel and KV-cache arguments."""
    if args.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}.")
    if args.prefix_caching_hash_algo not in HASH_ALGOS:
        raise ValueError(
            f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, got {args.prefix_caching_hash_algo!r}."
        )
    if not args.dp_cpus_per_engine > 0:
        raise ValueError(f"dp_cpus_per_engine must be > 0, got {args.dp_cpus_per_engine}.")
    if args.dp_retry and args.dp_lockstep:
        raise ValueError(
            "dp_retry cannot be combined with dp_lockstep: lockstep engines share one collective, so a dead "
            "engine stops them all and there is no live engine to continue on."
        )
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype (kv_cache_dtype) must be one of {', '.join(KV_CACHE_DTYPES)}, "
            f"got {args.kv_cache_dtype!r}."
        )
    if args.kv_cache_dtype != "auto" and (args.kv_transfer_config is not None or args.kv_offload_size):
        raise ValueError(
            f"--kv-cache-dtype {args.kv_cache_dtype} cannot be combined with a KV connector "
            "(--kv-transfer-config / --kv-offload-size): the connectors copy float KV blocks, not fp8 ones."
        )


def _check_logprobs_mode(args: EngineArgs) -> None:
    if args.logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(
            f"logprobs_mode (--logprobs-mode) must be one of {', '.join(LOGPROBS_MODES)}, got {args.logprobs_mode!r}."
        )
    if args.logprobs_mode.startswith("processed") and args.speculative_config is not None:
        raise ValueError(
            f"logprobs_mode={args.logprobs_mode} cannot be combined with speculative_config yet: the verification "
            "step returns raw logprobs only; use raw_logprobs or raw_logits."
        )


def _check_admission_limits(args: EngineArgs) -> None:
    """``max_num_queued_reqs`` / ``max_num_queued_tokens``: None (no limit) or >= 0; ``ValueError`` naming it."""
    for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
        value = getattr(args, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name} ({flag}) must be >= 0 (or unset: no limit), got {value!r}.")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
