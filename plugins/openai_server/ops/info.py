"""``GET /server_info`` (dev mode): the engine's config, the engine's environment variables and the system, in vLLM's
shape ``{"vllm_config", "vllm_env", "system_env"}``. Variables whose names hold ``KEY``, ``TOKEN`` or ``SECRET``
are left out, as vLLM leaves out ``KEY``s."""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import sys
from typing import Any

_HIDDEN = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def server_info(config: Any, config_format: str = "text", engine_info: Any = None) -> dict[str, Any]:
    """The ``/server_info`` answer: the config as text (``str``) or as JSON (``config_format="json"``), with what
    the engine settled at start-up (``engine_info``: the dtype ``auto`` resolved to, the context length and the KV
    block count) in place of what was asked for, as vLLM shows its resolved config."""
    if engine_info is not None:
        config = settled_config(config, engine_info)
    shown = str(config) if config_format == "text" else _jsonable(config)
    return {"vllm_config": shown, "vllm_env": engine_env(), "system_env": system_env()}


def settled_config(config: Any, engine_info: Any) -> Any:
    """``config`` with the engine's start-up facts: ``model_config.dtype`` and ``max_model_len``,
    ``cache_config.num_gpu_blocks``."""
    if not hasattr(config, "model_config") or not hasattr(config, "cache_config"):
        return config
    model_changes: dict[str, Any] = {"max_model_len": engine_info.max_model_len}
    if engine_info.dtype:
        model_changes["dtype"] = engine_info.dtype
    return dataclasses.replace(
        config,
        model_config=dataclasses.replace(config.model_config, **model_changes),
        cache_config=dataclasses.replace(config.cache_config, num_gpu_blocks=engine_info.num_gpu_blocks),
    )


def engine_env() -> dict[str, str]:
    """The ``VLLITE_*`` and ``VLLM_*`` variables set, secrets left out."""
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(("VLLITE_", "VLLM_")) and not any(word in name for word in _HIDDEN)
    }


@functools.lru_cache(maxsize=1)
def system_env() -> dict[str, Any]:
    """What the server runs on: versions of Python, torch and transformers, the OS, CPUs and accelerators."""
    import torch
    import transformers

    from vllite.version import __version__

    cuda = torch.cuda.is_available()
    return {
        "vllite_version": __version__,
        "python_version": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_version": str(torch.__version__),
        "transformers_version": str(transformers.__version__),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "gpu_models": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    }


def _jsonable(value: Any) -> Any:
    """A dataclass tree as JSON values; what JSON cannot hold (dtypes, paths, classes) as its ``str()``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
