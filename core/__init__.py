"""vllite: a small, plugin-centric LLM inference engine in the style of vLLM V1.

``import vllite`` stays light (no torch): the public names are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vllite import deprecated_aliases
from vllite.version import __version__

deprecated_aliases.install()  # renamed packages and moved builtins: old names for one release

if TYPE_CHECKING:
    from vllite.engine.llm import LLM
    from vllite.engine_args import EngineArgs
    from vllite.hookspecs import hookimpl
    from vllite.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from vllite.pooling_params import PoolingParams
    from vllite.sampling_params import RequestOutputKind, SamplingParams

_LAZY = {
    "LLM": "vllite.engine.llm",
    "AsyncLLM": "vllite.plugins.engine_proc.async_llm",
    "SamplingParams": "vllite.sampling_params",
    "RequestOutputKind": "vllite.sampling_params",
    "RequestOutput": "vllite.outputs",
    "CompletionOutput": "vllite.outputs",
    "PoolingParams": "vllite.pooling_params",
    "PoolingRequestOutput": "vllite.outputs",
    "EmbeddingRequestOutput": "vllite.outputs",
    "ClassificationRequestOutput": "vllite.outputs",
    "ScoringRequestOutput": "vllite.outputs",
    "EngineArgs": "vllite.engine_args",
    "hookimpl": "vllite.hookspecs",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
    "EngineArgs",
    "hookimpl",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
